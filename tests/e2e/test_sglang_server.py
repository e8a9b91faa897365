"""A real SGLang 0.5.23 server on this CPU (`python -m sglang.launch_server --device cpu`, a tiny local
model) under `kvdoctor run`, driven by SGLang's own `bench_serving` and by multi-turn chats with
shared prefixes, abandoned requests and long prompts, stopped with SIGINT, its trace judged.

Clean runs in several configurations give no error finding (SGLang's own strict idle check stays
on there: it would end the scheduler at a real leak). Faults planted in the scheduler
(`tests/support/sglang_fault`) are counted exactly, a leak is named within seconds while the load
goes on, and a probe put into a server that already leaked names exactly what it lost.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
from conftest import SUPPORT

sys.path.insert(0, SUPPORT)

import sglang_server

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(sglang_server.available()), reason=sglang_server.available() or "ok")]


def _events(trace: str) -> list[dict]:
    with open(trace) as fh:
        return [json.loads(line.rstrip().rstrip(",")) for line in fh if line.startswith("{")]


def _errors(report: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for finding in report["findings"]:
        if finding["severity"] == "error":
            out[finding["kind"]] = out.get(finding["kind"], 0) + finding["count"]
    return out


def _drive(server: sglang_server.Server) -> None:
    chats = server.conversations(turns=2, users=4)
    assert chats["ok"] >= 6 and chats["errors"] == 0, chats
    bench = server.bench_serving(prompts=24)
    assert bench.returncode == 0 and "Successful requests:                     24" in bench.stdout, bench.stderr[-2000:]


CONFIGS = {
    "radix, page 1": [],
    "page 16, chunked prefill 64, fcfs": ["--page-size", "16", "--chunked-prefill-size", "64", "--schedule-policy", "fcfs"],
    "no radix cache, page 16, no overlap, lof": [
        "--disable-radix-cache",
        "--page-size",
        "16",
        "--disable-overlap-schedule",
        "--schedule-policy",
        "lof",
    ],
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_clean_server_has_no_error_finding(tmp_path, config):
    server = sglang_server.Server(str(tmp_path), flags=CONFIGS[config]).start()
    try:
        _drive(server)
    finally:
        code = server.stop()
    assert code in (0, 130), server.log_tail()
    events = _events(server.trace)
    hooked = [e["args"]["reason"] for e in events if e["name"] == "probe_status" and "methods hooked" in e["args"].get("reason", "")]
    assert any("43 methods hooked" in reason for reason in hooked), hooked[-3:]
    censuses = [e["args"] for e in events if e["name"] == "census"]
    assert censuses and censuses[-1]["ledger_disagrees_slots"] == 0  # the ledger agrees with SGLang's own free list
    rc, report = sglang_server.replay(server.trace)
    assert rc == 0 and _errors(report) == {}, report["findings"][:3]


def test_a_leak_is_named_within_seconds_while_the_load_goes_on(tmp_path):
    server = sglang_server.Server(str(tmp_path), flags=["--disable-radix-cache"], fault="leak", fault_at=20).start()
    stop_load = threading.Event()

    def load() -> None:
        while not stop_load.is_set():
            server.conversations(turns=2, users=3, abort_every=0)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        deadline = time.monotonic() + 180
        named = None
        while named is None and time.monotonic() < deadline:
            time.sleep(0.5)
            planted = (server.fault() or {}).get("leak")
            if planted and os.path.exists(server.trace):
                named = next(
                    (e for e in _events(server.trace) if e["name"] == "violation" and e["args"].get("kind") == "orphan_slots"), None
                )
        assert planted and named, "the planted leak was not named"
        delay_s = named["ts"] / 1e6 - planted["time_s"]
        assert delay_s < 10.0 and loader.is_alive(), f"named {delay_s:.1f} s after the drop"
    finally:
        stop_load.set()
        loader.join(timeout=300)
        server.stop()
    assert named["args"]["count"] == planted["count"]
    assert named["args"]["slot_ids"] == planted["slot_ids"][:64]
    rc, report = sglang_server.replay(server.trace)
    assert rc == 1 and _errors(report) == {"orphan_slots": planted["count"]}, report["findings"][:3]


def test_planted_double_free_stale_last_loc_and_index_out_of_range_are_counted_exactly(tmp_path):
    faults = "double-free,stale-last-loc,index-out-of-range"
    server = sglang_server.Server(str(tmp_path), flags=["--page-size", "16", "--disable-radix-cache"], fault=faults, fault_at=20).start()
    try:
        _drive(server)
    finally:
        server.stop()
    planted = server.fault() or {}
    assert set(planted) == set(faults.split(",")), planted
    rc, report = sglang_server.replay(server.trace)
    assert rc == 1
    assert _errors(report) == {"double_free": planted["double-free"]["count"], "stale_last_loc": 1, "index_out_of_range": 2}
    oor = next(f for f in report["findings"] if f["kind"] == "index_out_of_range")
    assert -5 in {oor["evidence"].get("bad_index")} | set(oor["evidence"].get("slot_ids") or [])
    double = next(f for f in report["findings"] if f["kind"] == "double_free")
    page = planted["double-free"]["page_size"]  # a freed page is named by all its slots, a request may fill it partly
    assert {s // page for s in double["evidence"]["slot_ids"]} <= {s // page for s in planted["double-free"]["slot_ids"]}


def test_a_probe_put_into_a_server_that_already_leaked_names_exactly_what_it_lost(tmp_path):
    """Started without kvdoctor; a leak; then the probe goes in with the code `kvdoctor attach`
    injects (gdb itself cannot call into processes on this machine: see test_attach)."""
    server = sglang_server.Server(
        str(tmp_path), probe=False, flags=["--disable-radix-cache"], fault="leak", fault_at=10, attach_on_signal=True
    ).start()
    trace = str(tmp_path / "attached.kvtrace.json")
    try:
        _drive(server)
        planted = (server.fault() or {}).get("leak")
        assert planted, "the leak was not planted"
        status = server.attach_now(trace)
        assert status.get("ok"), status
        server.conversations(turns=2, users=2)  # hooked calls after the attach: the ledger adopts the pool then
    finally:
        server.stop()
    adopted = [e["args"] for e in _events(trace) if e["name"] == "probe_status" and e["args"].get("adopted")]
    assert adopted and adopted[0]["held_by_no_one_slots"] == planted["count"]
    rc, report = sglang_server.replay(trace)
    assert _errors(report) == {"orphan_slots": planted["count"]}, report["findings"][:3]
    leak = next(f for f in report["findings"] if f["kind"] == "orphan_slots")
    assert "leaked before kvdoctor attached" in leak["message"]
    assert set(leak["evidence"]["slot_ids"]) <= set(planted["slot_ids"])
