"""The decode side of a real SGLang 0.5.23 prefill/decode pair (the fake transfer backend), under
`kvdoctor run`, with two dropped frees planted by the server tests' fault door: a segment of KV slots (`leak`) and,
in another request, the request pool row itself (`row-leak`: `DecodeReqToTokenPool.free` skipped).
The request pool is `DecodeReqToTokenPool` (its own class, not a `ReqToTokenPool`), which the map
judges as the request pool there: the slot ledger names the dropped slots exactly, with the request
whose row held them, the row left behind is named with its request, and nothing else is. The clean
decode server is test_coverage_servers.py's.
"""

from __future__ import annotations

import sys
import threading

import pytest
from conftest import SUPPORT, trace_events

from kvdoctor.probe.base.vocabulary import MAX_IDS_IN_EVIDENCE

sys.path.insert(0, SUPPORT)

import servers
import sglang_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("needs_sglang_server")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("pd-decode-leak"))
    server = sglang_server.Server(
        folder, flags=sglang_server.DECODE_FLAGS, fault="leak,row-leak", fault_at=3, env={"KVDOCTOR_TEST_FAULT_ROW_AT": "5"}
    ).start()
    produced: list[int] = []
    try:
        threads = [
            threading.Thread(target=lambda n=n: produced.append(sglang_server.generate_with_bootstrap(server.base_url, n, 48)))
            for n in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # The eight ran as one batch, which the idle scheduler keeps as its last (with their request
        # objects): one more request replaces it, and the left row's request is gone from then on.
        produced.append(sglang_server.generate_with_bootstrap(server.base_url, 8, 48))
        servers.wait_for(lambda: any(e["args"]["kind"] == "request_rows_leaked" for e in trace_events(server.trace, "violation")), 60)
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    assert produced == [48] * 9, produced
    rc, report = sglang_server.replay(server.trace)
    return server, server.fault() or {}, rc, report


def test_the_request_pool_is_judged(served):
    server, _, _, _ = served
    coverage = [e["args"] for e in trace_events(server.trace, "probe_status") if e["args"].get("component") == "coverage"][-1]
    assert coverage["engine_pools"]["req_to_token_pool"] == "DecodeReqToTokenPool", coverage
    assert coverage["ledgers"] == {"TokenToKVPoolAllocator#0": "judged"}, coverage


def test_the_dropped_free_is_named_exactly_with_its_request(served):
    _, planted, rc, report = served
    leak = planted.get("leak")
    assert leak and leak["count"] > 0, planted
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    (named,) = [f for f in errors if f["kind"] == "orphan_slots"]
    evidence = named["evidence"]
    # the count exactly, and the first of its slots (the evidence keeps a bounded sample, in order)
    assert named["count"] == leak["count"] and evidence["slot_ids"] == leak["slot_ids"][:MAX_IDS_IN_EVIDENCE], (named, leak)
    # by the one row that held them all, and its request
    assert list(evidence["requests"].values()) == [leak["count"]] and leak["rid"] in next(iter(evidence["requests"])), evidence["requests"]
    # allocated where a decode server takes them: its pre-allocation for the transfer, then its decode steps
    assert any("disaggregation/decode.py" in site for site in evidence["allocated_at"]), evidence["allocated_at"]
    assert sum(evidence["allocated_at"].values()) == leak["count"], evidence["allocated_at"]
    assert sorted(f["kind"] for f in errors) == ["orphan_slots", "request_rows_leaked"], [f["kind"] for f in errors]
    assert rc == 1


def test_the_row_left_behind_is_named_with_its_request(served):
    server, planted, _, report = served
    row = planted.get("row-leak")
    assert row and row["rid"] and row["rid"] != planted["leak"]["rid"], planted
    (named,) = [f for f in report["findings"] if f["kind"] == "request_rows_leaked"]
    assert named["severity"] == "error" and named["count"] == 1 and named["evidence"]["slot_ids"] == row["slot_ids"], named
    assert list(named["evidence"]["requests"]) == [f"req_pool_idx {row['slot_ids'][0]} (rid {row['rid']})"], named["evidence"]
    assert "DecodeReqToTokenPool" in named["message"], named["message"]
    # named, the row counts as finished: the engine's idle censuses go on, and judge
    (left,) = [e for e in trace_events(server.trace, "violation") if e["args"]["kind"] == "request_rows_leaked"]
    idle = [e["args"] for e in trace_events(server.trace, "census") if e["args"]["reason"] == "idle" and e["ts"] > left["ts"]]
    assert idle and idle[-1]["live_requests"] == 0 and idle[-1].get("judged", True), idle[-1:]
