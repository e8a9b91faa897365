"""A real SGLang 0.5.23 server with a hybrid model (the tiny LFM2: short-conv layers, whose per-request
conv state lives in SGLang's `MambaPool`, beside full-attention layers), under `kvdoctor run`, on a
clean load of multi-turn chats sharing prefixes. Only the conv layers' math is stood in
(tests/support/lfm2_standins.py); SGLang builds `HybridReqToTokenPool`, `MambaPool`,
`MambaSlotAllocator` and a FULL + MAMBA `UnifiedRadixCache` itself.

What kvdoctor may say of it today: nothing false. Its KV slot ledger counts (double frees and
out-of-range indices stay its own) but does not judge orphans, because the request pool's own
`alloc` and `clear` take Mamba slots past the hooks; the Mamba state pools are named as counted by
no ledger. A clean run names no error, and the coverage line says each of those, by name.
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
    folder = str(tmp_path_factory.mktemp("hybrid-server"))
    model = sglang_server.ensure_lfm2_model()
    server = sglang_server.Server(folder, model=model, max_total_tokens=32768, env={"KVDOCTOR_TEST_LFM2_STANDINS": "1"})
    server.start(timeout_s=600)  # two cores, shared: a start takes minutes
    try:
        chats = server.conversations(turns=2, users=4, abort_every=0)
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    rc, report = sglang_server.replay(server.trace)
    return server, chats, rc, report


def test_the_hybrid_server_served_its_chats(served):
    server, chats, _, _ = served
    assert chats["errors"] == 0 and chats["ok"] > 0, chats


def test_a_clean_hybrid_load_names_no_error(served):
    _, _, rc, report = served
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert rc == 0 and errors == [], errors


def test_what_is_not_judged_is_said_by_name(served):
    server, _, _, report = served
    coverage = [e["args"] for e in trace_events(server.trace, "probe_status") if e["args"].get("component") == "coverage"][-1]
    pools = coverage["engine_pools"]
    assert pools["req_to_token_pool"] == "HybridReqToTokenPool" and pools["req_to_token_pool.mamba_pool"] == "MambaPool", pools
    assert pools["req_to_token_pool.mamba_allocator"] == "MambaSlotAllocator", pools
    (why,) = coverage["ledgers"].values()
    assert "HybridReqToTokenPool.alloc" in why, coverage["ledgers"]
    assert (
        "not counted by any ledger" in coverage["reason"] and "MambaSlotAllocator (req_to_token_pool.mamba_allocator)" in coverage["reason"]
    )
    partial = [f for f in report["findings"] if f["kind"] == "probe_partial" and f["severity"] == "warning"]
    assert any("HybridReqToTokenPool" in f["message"] for f in partial), partial
