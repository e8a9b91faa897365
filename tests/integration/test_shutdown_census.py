"""The census asked for at shutdown, in a real process holding SGLang's real allocator and request
pool under the probe, then killed with SIGKILL as SGLang's launcher kills its scheduler.

- Quiet (no live request, no hooked call): it answers with a census taken then, which names a
  leak made just before, and the census is in the trace before the answer (the kill follows).
- Busy (a live request, hooked calls every few milliseconds): it waits for quiet, then answers with
  its last rolling census and that census's age, never a census racing the calls.
- A process whose probe turned itself off answers at once that it has no census, so the shutdown
  is not held for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import REPO, trace_events

from kvdoctor.probe.base.shutdown import ENV_RENDEZVOUS, Rendezvous
from kvdoctor.probe.engines.sglang.state import SHUTDOWN_BUSY_WAIT_S

ENGINE = textwrap.dedent(
    """
    import json, sys, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    from kvdoctor.probe.core import runtime
    probe = runtime.activate(sys.argv[1])
    from kvdoctor.demo.workload import Engine, Request
    mode = sys.argv[2]
    engine = Engine(pool_tokens=512, page_size=1)
    done = Request("done")
    (row,) = engine.req_pool.alloc([done])
    slots = engine.allocator.alloc(16)
    engine.req_pool.write((row, slice(0, 16)), slots.to(torch.int32))
    engine.allocator.free(slots)
    engine.req_pool.free(done)  # the engine is idle now
    dropped = []
    if mode in ("quiet", "busy"):
        dropped = [int(s) for s in engine.allocator.alloc(8)]  # handed out, never written to a row, never freed
    if mode == "off":
        probe.fail("test", RuntimeError("planted"))
    if mode == "busy":
        live = Request("still-decoding")
        (live_row,) = engine.req_pool.alloc([live])

        def decode():
            while True:
                s = engine.allocator.alloc(1)
                engine.allocator.free(s)
                time.sleep(0.005)

        threading.Thread(target=decode, daemon=True).start()
    print("READY " + json.dumps({"dropped": dropped}), flush=True)
    time.sleep(600)
    """
)


def _start(tmp_path, mode: str) -> tuple[subprocess.Popen, str, dict]:
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    trace = str(tmp_path / "t.kvtrace.json")
    env = {**os.environ, ENV_RENDEZVOUS: str(rendezvous), "KVDOCTOR_ROLLING_CENSUS_S": "0.5"}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, trace, mode], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    return proc, str(rendezvous), json.loads(line[len("READY ") :])


def _ask_then_kill(proc: subprocess.Popen, rendezvous: str, wait_s: float = 10.0) -> dict:
    try:
        outcome = Rendezvous(rendezvous).ask_and_wait(wait_s=wait_s)
    finally:
        proc.send_signal(signal.SIGKILL)  # as SGLang's kill_process_tree does, right after
        proc.wait(timeout=30)
    return outcome


def test_a_quiet_process_answers_with_a_census_that_names_a_leak_made_just_before(tmp_path):
    proc, rendezvous, ready = _start(tmp_path, "quiet")
    started = time.monotonic()
    outcome = _ask_then_kill(proc, rendezvous)
    assert time.monotonic() - started < 5.0
    assert outcome["unanswered"] == [] and outcome["answered"][proc.pid]["census"] == "shutdown", outcome
    censuses = [e["args"] for e in trace_events(str(tmp_path / "t.kvtrace.json"), "census")]
    shutdown = [c for c in censuses if c["reason"] == "shutdown"]
    assert shutdown, [c["reason"] for c in censuses]  # written before the answer, though killed right after
    assert shutdown[-1]["orphan_slots"] == 8 and sorted(shutdown[-1]["orphan_slot_ids"]) == sorted(ready["dropped"])


def test_a_busy_process_waits_for_quiet_then_answers_with_its_rolling_census_and_its_age(tmp_path):
    proc, rendezvous, ready = _start(tmp_path, "busy")
    time.sleep(2.0)  # rolling censuses every 0.5 s: the dropped slots persist across two
    outcome = _ask_then_kill(proc, rendezvous)
    answer = outcome["answered"][proc.pid]
    assert answer["census"] == "rolling" and answer["waited_s"] >= SHUTDOWN_BUSY_WAIT_S, outcome
    censuses = [e["args"] for e in trace_events(str(tmp_path / "t.kvtrace.json"), "census")]
    assert not [c for c in censuses if c["reason"] == "shutdown"]  # never taken while the calls went on
    last = censuses[-1]
    assert last["reason"] == "rolling" and last["at_shutdown"] is True and 0 <= last["age_s"] < 5.0, last
    assert last["orphan_slots"] == 8 and sorted(last["orphan_slot_ids"]) == sorted(ready["dropped"])
    assert last["live_requests"] == 1


def test_a_process_whose_probe_is_off_answers_at_once_with_no_census(tmp_path):
    proc, rendezvous, _ = _start(tmp_path, "off")
    started = time.monotonic()
    outcome = _ask_then_kill(proc, rendezvous)
    assert time.monotonic() - started < 5.0
    answer = outcome["answered"][proc.pid]
    assert answer["census"] == "none" and "planted" in answer["reason"], answer
