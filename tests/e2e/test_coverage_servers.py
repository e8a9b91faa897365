"""Real SGLang 0.5.23 servers of the kinds people run in 2026, clean, under `kvdoctor run`: no error
finding, and the probe says which pools it judges and why not the others.

- A sliding-window model (a tiny Mellum made locally): SGLang builds `SWATokenToKVPoolAllocator`
  over a full and an SWA token allocator. Before the coverage check kvdoctor named thousands of
  slots of this clean server as leaked; now the composite is judged as one pool (its planted drops:
  test_swa_server.py).
- The decode side of prefill/decode disaggregation (the fake transfer backend): the request pool is
  `DecodeReqToTokenPool`. Unhooked, it made 16 requests of 150 tokens a false `orphan_slots` of over
  a thousand slots, then a pool said not judged; now it is judged as the request pool (its planted
  drop: test_pd_decode_server.py).
"""

from __future__ import annotations

import sys
import threading

import pytest
from conftest import SUPPORT, trace_events

sys.path.insert(0, SUPPORT)

import sglang_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("needs_sglang_server")]


def _errors(report: dict) -> list[str]:
    return [f"{f['kind']} x{f['count']}: {f['message'][:200]}" for f in report["findings"] if f["severity"] == "error"]


def _coverage(trace: str) -> dict:
    statuses = [e["args"] for e in trace_events(trace, "probe_status") if e["args"].get("component") == "coverage"]
    assert statuses, "no coverage line in the trace"
    return statuses[-1]


def test_a_clean_sliding_window_server_is_not_accused_and_says_why(tmp_path):
    model = sglang_server.ensure_swa_model()
    server = sglang_server.Server(str(tmp_path), model=model, max_total_tokens=32768).start(timeout_s=600)
    try:
        chats = server.conversations(turns=2, users=4)
        bench = server.bench_serving(prompts=24)
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    assert chats["errors"] == 0 and bench.returncode == 0, (chats, bench.stderr[-1500:])
    rc, report = sglang_server.replay(server.trace)
    assert rc == 0 and _errors(report) == [], _errors(report)[:3]
    coverage = _coverage(server.trace)
    assert coverage["state"] == "on" and coverage["engine_pools"]["token_to_kv_pool_allocator"] == "SWATokenToKVPoolAllocator"
    parts = {k: v for k, v in coverage["engine_pools"].items() if k.startswith("token_to_kv_pool_allocator.")}
    assert sorted(parts.values()) == ["TokenToKVPoolAllocator", "TokenToKVPoolAllocator"], coverage["engine_pools"]
    # the composite is judged as one pool: each part's ledger, named by its part, judges
    assert coverage["ledgers"] == {"swa/TokenToKVPoolAllocator#0": "judged", "full/TokenToKVPoolAllocator#1": "judged"}, coverage
    assert coverage["composites"]["SWATokenToKVPoolAllocator"].startswith("judged as one pool"), coverage
    # and each idle or exit census of the SWA side held its books to SGLang's own SWA counts before judging
    swa = [e["args"] for e in trace_events(server.trace, "census") if e["args"]["allocator"].startswith("swa/") and e["args"]["idle"]]
    judged = [c for c in swa if c.get("judged", True)]
    assert judged and all(c["tree_slots"] == c["tree_evictable_slots"] + c["tree_protected_slots"] for c in judged), swa[-1:]
    assert all(c["ledger_disagrees_slots"] == 0 and c["orphan_slots"] == 0 for c in judged), judged[-1:]
    assert "orphans not judged" not in server.log_tail(20000)


def test_a_clean_pd_decode_server_is_not_accused_and_says_why(tmp_path):
    server = sglang_server.Server(str(tmp_path), flags=sglang_server.DECODE_FLAGS).start()
    produced: list[int] = []
    try:
        threads = [
            threading.Thread(target=lambda n=n: produced.append(sglang_server.generate_with_bootstrap(server.base_url, n)))
            for n in range(16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    assert produced == [150] * 16, produced
    rc, report = sglang_server.replay(server.trace)
    assert rc == 0 and _errors(report) == [], _errors(report)[:3]
    coverage = _coverage(server.trace)
    assert coverage["state"] == "on" and coverage["engine_pools"]["req_to_token_pool"] == "DecodeReqToTokenPool", coverage
    assert set(coverage["ledgers"].values()) == {"judged"}, coverage["ledgers"]
    # every idle or exit census held its books to SGLang's own (free + tree = the pool) and found no orphan
    censuses = [e["args"] for e in trace_events(server.trace, "census") if e["args"].get("idle") or e["args"].get("reason") == "shutdown"]
    assert censuses and all(c.get("judged", True) and c["ledger_disagrees_slots"] == 0 and c["orphan_slots"] == 0 for c in censuses), (
        censuses[-1:]
    )
    # the PD decode transfer ledger followed every transfer to Success (warmup and health checks too) and named nothing
    (last,) = trace_events(server.trace, "pd_transfers")[-1:]
    counts = last["args"]
    assert counts["followed"] == 0 and counts["done"] >= 16 and counts["freed_in_flight"] == counts["released_not_judged"] == 0, counts


def test_a_clean_tensor_parallel_server_names_each_ranks_ledgers_apart(tmp_path):
    """`--tp-size 2` (SGLang's gloo fallback on CPU: no NCCL library, one OpenMP core per rank): two
    schedulers, each with its own pool. Under clean load no error, each rank's pool is judged, and
    its ledger is named with its rank, so two ranks never read as one."""
    env = {"SGLANG_NCCL_SO_PATH": str(tmp_path / "no-nccl.so"), "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    server = sglang_server.Server(str(tmp_path), flags=["--tp-size", "2"], env=env).start(timeout_s=600)  # two ranks on two cores
    try:
        chats = server.conversations(turns=2, users=3)
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    assert chats["errors"] == 0, chats
    rc, report = sglang_server.replay(server.trace)
    # Two ranks sharing two cores for about a minute grow through their warm-up (once in three runs
    # steadily enough to read as 2.25 GiB/h over 36 s, 22 MiB in all): under the 64 MiB a climb
    # must rise, so no growth error either.
    errors = _errors(report)
    assert errors == [], errors[:3]
    ledgers: dict[int, set[str]] = {}
    for event in trace_events(server.trace, "probe_status"):
        if event["args"].get("component") == "ledger" and event["args"].get("allocator"):
            ledgers.setdefault(event["pid"], set()).add(event["args"]["allocator"])
    assert sorted(sorted(names) for names in ledgers.values()) == [["tp0/TokenToKVPoolAllocator#0"], ["tp1/TokenToKVPoolAllocator#0"]], (
        ledgers
    )
    judged = {e["pid"]: e["args"] for e in trace_events(server.trace, "probe_status") if e["args"].get("component") == "coverage"}
    assert len(judged) == 2 and all(c["state"] == "on" for c in judged.values()), judged
    censuses = [e for e in trace_events(server.trace, "census") if e["args"].get("idle") or e["args"].get("reason") == "shutdown"]
    assert {e["args"]["allocator"] for e in censuses} == {"tp0/TokenToKVPoolAllocator#0", "tp1/TokenToKVPoolAllocator#0"}, censuses[-2:]
