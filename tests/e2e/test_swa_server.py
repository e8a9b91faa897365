"""A real SGLang 0.5.23 server with a sliding-window model (the tiny Mellum), under `kvdoctor run`,
with two dropped frees planted by the server tests' fault door: a full side's (`leak`: a
`free_segment` of the full part skipped) and an SWA side's (`swa-leak`: the composite's
`free_swa_segment` skipped inside its `free_segment`, the full slots freed, their SWA slots left
allocated and still mapped). kvdoctor judges the composite as one pool (`swa_sides.py`): each drop is
named exactly, on its own side's ledger, with its request, and nothing else is. One server for the
file (its start is most of the time).
"""

from __future__ import annotations

import sys

import pytest
from conftest import SUPPORT, trace_events

sys.path.insert(0, SUPPORT)

import sglang_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("needs_sglang_server")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("swa-server"))
    model = sglang_server.ensure_swa_model()
    server = sglang_server.Server(
        folder, model=model, max_total_tokens=32768, fault="leak,swa-leak", fault_at=3, env={"KVDOCTOR_TEST_FAULT_SWA_AT": "2"}
    ).start(timeout_s=600)  # two cores, shared: a start takes minutes
    try:
        chats = server.conversations(turns=2, users=4, abort_every=0)
        # The SWA drop is planted in a segment a request gives back whole, and with one-slot pages
        # those are the duplicates a tree insert exposes: two users of one prefix group prefilled
        # in the same batch, which the scheduler's timing decides (2 such calls in a quiet run, at
        # times fewer under load). More chats until both drops are in, a bounded number of rounds.
        for seed in range(1, 6):
            if {"leak", "swa-leak"} <= set(server.fault() or {}):
                break
            more = server.conversations(turns=1, users=8, abort_every=0, seed=seed)
            chats = {key: chats[key] + more[key] for key in chats}
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    assert chats["errors"] == 0, chats
    rc, report = sglang_server.replay(server.trace)
    return server, {**(server.fault() or {}), "seen": server.fault_seen()}, rc, report


def _errors(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["severity"] == "error"]


def _named_on(report: dict, part: str) -> list[dict]:
    return [f for f in _errors(report) if f["kind"] == "orphan_slots" and f"{part}/TokenToKVPoolAllocator" in f["evidence"]["allocator"]]


def test_both_drops_were_planted(served):
    _, planted, _, _ = served
    full, swa = planted.get("leak"), planted.get("swa-leak")
    assert full and swa and swa["rid"], planted
    assert swa["count"] == len(swa["slot_ids"]) > 0 and not set(full["slot_ids"]) & set(swa["full_slot_ids"]), planted


def test_the_composite_is_judged_as_one_pool(served):
    server, _, _, _ = served
    coverage = [e["args"] for e in trace_events(server.trace, "probe_status") if e["args"].get("component") == "coverage"][-1]
    assert coverage["engine_pools"]["token_to_kv_pool_allocator"] == "SWATokenToKVPoolAllocator"
    assert sorted(coverage["ledgers"]) == ["full/TokenToKVPoolAllocator#1", "swa/TokenToKVPoolAllocator#0"], coverage["ledgers"]
    assert set(coverage["ledgers"].values()) == {"judged"}, coverage["ledgers"]
    assert coverage["composites"]["SWATokenToKVPoolAllocator"].startswith("judged as one pool"), coverage
    # the SWA side's last census held its books to SGLang's own SWA counts, and judged
    (last,) = [e["args"] for e in trace_events(server.trace, "census") if e["args"]["allocator"].startswith("swa/")][-1:]
    assert last["idle"] and last.get("judged", True) and last["ledger_disagrees_slots"] == 0, last
    assert last["tree_slots"] == last["tree_evictable_slots"] + last["tree_protected_slots"] == last["swa_tree_read_slots"], last


def test_the_full_side_drop_is_named_exactly(served):
    _, planted, rc, report = served
    full = planted["leak"]
    (named,) = _named_on(report, "full")
    assert named["count"] == full["count"] and named["evidence"]["slot_ids"] == full["slot_ids"], named
    # by the row that held them (a duplicate the tree's insert freed is out of the row by its release,
    # so a census names it, by the row's last request)
    assert all(request.startswith("req_pool_idx ") for request in named["evidence"]["requests"]), named["evidence"]["requests"]
    assert any("allocation.py" in site for site in named["evidence"]["allocated_at"]), named["evidence"]
    assert rc == 1


def test_the_swa_side_drop_is_named_exactly(served):
    server, planted, _, report = served
    swa = planted["swa-leak"]
    (named,) = _named_on(report, "swa")
    assert named["count"] == swa["count"] and named["evidence"]["slot_ids"] == swa["slot_ids"][:64], named
    # named once the frees of its free group were in, with the request whose row held the full slots
    (released,) = [e["args"] for e in trace_events(server.trace, "violation") if e["args"]["allocator"].startswith("swa/")]
    assert released["count"] == swa["count"] and released["slot_ids"] == swa["slot_ids"][:64], released
    assert released["full_slot_ids"] == swa["full_slot_ids"][:64] and swa["rid"] in released["request"], released
    assert any("allocation.py" in site for site in released["allocated_at"]), released


def test_nothing_else_is_named(served):
    _, _, _, report = served
    errors = _errors(report)
    assert sorted(f["evidence"]["allocator"].split("/")[0] for f in errors) == ["full", "swa"], [
        (f["kind"], f["count"], f["message"][:200]) for f in errors
    ]
