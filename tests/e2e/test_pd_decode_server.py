"""The decode side of a real SGLang 0.5.23 prefill/decode pair (the fake transfer backend), under
`kvdoctor run`, with a dropped free planted by the server tests' fault door: the request pool is
`DecodeReqToTokenPool` (its own class, not a `ReqToTokenPool`), which the map judges as the request
pool there, so the slot ledger names the drop exactly, with the request whose row held it, and
nothing else. The clean decode server is test_coverage_servers.py's.
"""

from __future__ import annotations

import sys
import threading

import pytest
from conftest import SUPPORT, trace_events

from kvdoctor.probe.base.vocabulary import MAX_IDS_IN_EVIDENCE

sys.path.insert(0, SUPPORT)

import sglang_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("needs_sglang_server")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("pd-decode-leak"))
    server = sglang_server.Server(folder, flags=sglang_server.DECODE_FLAGS, fault="leak", fault_at=3).start()
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
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    assert produced == [48] * 8, produced
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
    assert [f["kind"] for f in errors] == ["orphan_slots"], [f["kind"] for f in errors]
    assert rc == 1
