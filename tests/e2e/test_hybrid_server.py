"""A real SGLang 0.5.23 server with a hybrid model (the tiny LFM2: short-conv layers, whose per-request
conv state lives in SGLang's `MambaPool`, beside full-attention layers), under `kvdoctor run`. Only
the conv layers' math is stood in (tests/support/lfm2_standins.py); SGLang builds
`HybridReqToTokenPool`, `MambaPool`, `MambaSlotAllocator` and a FULL + MAMBA `UnifiedRadixCache`.

- clean, radix cache on, multi-turn chats sharing prefixes: no error; the KV slot ledger judges
  (the request pool's own `alloc` takes its rows through the hooked `ReqToTokenPool.alloc`, and its
  hook checks so), and the Mamba slots are judged at the quiet censuses, balanced against SGLang's
  own counts (free list, the tree's Mamba values);
- a dropped free, radix cache off (every finished request gives its Mamba slot back through
  `HybridReqToTokenPool.free_mamba_cache`; the fault door skips the 3rd): the one slot is named,
  with its request, and nothing else is.
"""

from __future__ import annotations

import sys
import time

import pytest
from conftest import SUPPORT, trace_events

sys.path.insert(0, SUPPORT)

import sglang_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("needs_sglang_server")]

QUIET_S = 3.0  # past the probe's quiet wait (0.5 s) and its idle census interval (2 s)


def _serve(folder: str, flags: list[str] | None = None, fault: str = "") -> tuple:
    server = sglang_server.Server(
        folder,
        model=sglang_server.ensure_lfm2_model(),
        flags=flags,
        max_total_tokens=32768,
        fault=fault,
        fault_at=3,
        env={"KVDOCTOR_TEST_LFM2_STANDINS": "1"},
    )
    server.start(timeout_s=600)  # two cores, shared: a start takes minutes
    chats = []
    try:
        for seed in range(2):  # two loads, each followed by a quiet engine: two quiet censuses at least
            chats.append(server.conversations(turns=2, users=4, abort_every=0, seed=seed))
            time.sleep(QUIET_S)
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    rc, report = sglang_server.replay(server.trace)
    return server, chats, rc, report


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _serve(str(tmp_path_factory.mktemp("hybrid-clean")))


@pytest.fixture(scope="module")
def leaky(tmp_path_factory):
    return _serve(str(tmp_path_factory.mktemp("hybrid-leak")), ["--disable-radix-cache"], fault="mamba-leak")


def _errors(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["severity"] == "error"]


def _coverage(server) -> dict:
    return [e["args"] for e in trace_events(server.trace, "probe_status") if e["args"].get("component") == "coverage"][-1]


def test_the_hybrid_server_served_its_chats(clean):
    _, chats, _, _ = clean
    assert all(c["errors"] == 0 and c["ok"] > 0 for c in chats), chats


def test_a_clean_hybrid_load_names_no_error(clean):
    _, _, rc, report = clean
    assert rc == 0 and _errors(report) == [], _errors(report)


def test_the_kv_ledger_and_the_mamba_slots_are_judged(clean):
    server, _, _, _ = clean
    coverage = _coverage(server)
    pools = coverage["engine_pools"]
    assert pools["req_to_token_pool"] == "HybridReqToTokenPool" and pools["req_to_token_pool.mamba_allocator"] == "MambaSlotAllocator"
    assert set(coverage["ledgers"].values()) == {"judged"}, coverage["ledgers"]
    assert "MambaSlotAllocator (req_to_token_pool.mamba_allocator): judged when the engine is quiet" in coverage["reason"]
    assert "req_to_token_pool.mamba_allocator" not in coverage["untracked_pools"], coverage["untracked_pools"]
    assert "req_to_token_pool.short_conv_pool" in coverage["untracked_pools"]  # still said: no ledger counts it
    assert not [e for e in trace_events(server.trace, "probe_status") if e["args"].get("component") == "mamba_slots"]


def test_the_mamba_books_balance_against_sglangs_own_counts(clean):
    server, _, _, _ = clean
    censuses = [e["args"] for e in trace_events(server.trace, "mamba_pool")]
    assert censuses, "no quiet census of the Mamba slots"
    # A census can meet the scheduler taking a new request's slot between two of its reads (a
    # prefix match copies state into a fresh slot before any hooked call): its books then disagree
    # with SGLang's count and it names nothing, as it must. The last, after the load, balances.
    for census in censuses:
        assert census["quiet"] and census["unaccounted"] == 0, census
    last = censuses[-1]
    assert last["books_disagree"] == 0 and last["tree"] == last["tree_counted"] > 0, last
    assert last["free"] + last["tree"] == last["slots"], last


def test_a_dropped_mamba_free_is_named_exactly(leaky):
    server, chats, rc, report = leaky
    assert all(c["errors"] == 0 for c in chats), chats
    planted = server.fault()["mamba-leak"]
    (finding,) = _errors(report)
    assert finding["kind"] == "mamba_orphan_slots" and finding["count"] == 1, finding
    assert finding["evidence"]["slot_ids"] == planted["slot_ids"], (finding, planted)
    assert finding["evidence"]["requests"] == {planted["rid"]: 1}, (finding, planted)
    assert finding["evidence"]["site"].startswith("alloc_req_slots"), finding  # the caller of the hooked HybridReqToTokenPool.alloc
    assert finding["evidence"]["quiet"] is True and "free_mamba_cache" in finding["message"], finding
    last = [e["args"] for e in trace_events(server.trace, "mamba_pool")][-1]
    assert last["unaccounted"] == 1 and last["books_disagree"] == 0 and last["tree"] == 0, last
