"""Leaks named while the engine is busy, on SGLang's real allocator, radix tree and request pool: at
the leaking request's release (with that request's id, not the row's later user), and by the
rolling census (slots allocated and dropped without ever being written to a request's row)."""

import json
import os
import subprocess
import sys
import time

from conftest import REPO

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

LEAK_RUN = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
from kvdoctor.probe.core import runtime
runtime.activate(sys.argv[1])
from kvdoctor.demo.workload import WorkloadConfig, run_workload
config = WorkloadConfig(fault="leak", fault_at_request=int(sys.argv[2]))
result = run_workload(config)
runtime.deactivate()
print("PLANTED " + json.dumps(result.planted))
"""


def _events(path):
    return list(iter_events(str(path)))


def test_a_leak_is_named_at_the_release_of_the_request_that_leaked(tmp_path):
    trace = tmp_path / "t.kvtrace.json"
    proc = subprocess.run([sys.executable, "-c", LEAK_RUN, str(trace), "9"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    planted = json.loads(proc.stdout.split("PLANTED ", 1)[1])["orphan_slots"]
    events = _events(trace)
    released = [e for e in events if e.name == schema.VIOLATION and e.args.get("kind") == schema.ORPHAN_SLOTS]
    assert [e.args["count"] for e in released] == [planted]
    assert "rid conv9-req9" in released[0].args["request"]  # request number 9 is the one the workload made leak

    # The whole trace: the exit census is the verdict, and it names the request that leaked.
    (finding,) = [f for f in analyze(iter(events)).findings if f.kind == schema.ORPHAN_SLOTS]
    assert finding.count == planted and list(finding.evidence["requests"]) == [released[0].args["request"]]

    # Killed while busy (no census after the release): the release alone is the finding.
    cut = [e for e in events if not (e.name == schema.CENSUS and e.ts > released[0].ts)]
    (busy,) = [f for f in analyze(iter(cut)).findings if f.kind == schema.ORPHAN_SLOTS]
    assert busy.count == planted and "conv9-req9" in busy.message and "busy" in busy.message
    assert busy.evidence["slot_ids"] == released[0].args["slot_ids"]


def test_the_rolling_census_names_slots_dropped_while_requests_stay_live(tmp_path, monkeypatch):
    import torch

    from kvdoctor.demo.workload import Engine, Request
    from kvdoctor.probe.core import runtime

    monkeypatch.setenv("KVDOCTOR_ROLLING_CENSUS_S", "0.3")
    trace = tmp_path / "t.kvtrace.json"
    probe = runtime.activate(str(trace))
    try:
        engine = Engine(pool_tokens=512, page_size=1)
        live = Request("still-decoding")
        (row,) = engine.req_pool.alloc([live])
        held = engine.allocator.alloc(16)
        engine.req_pool.write((row, slice(0, 16)), held.to(torch.int32))  # owned by a live request: fine
        dropped = engine.allocator.alloc(8)  # handed out, never written to a row, never freed
        wanted = sorted(int(s) for s in dropped)

        def rolling():
            probe.emitter.flush()
            return [e.args for e in _events(trace) if e.name == schema.CENSUS and e.args.get("reason") == "rolling"]

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(c["orphan_slots"] for c in rolling()):
            time.sleep(0.1)
        # the first census is emitted clean (a verdict exists from the first one on); the slots are
        # named once they stayed orphaned across two
        first, named = rolling()[0], next(c for c in rolling() if c["orphan_slots"])
        assert first["orphan_slots"] == 0
        assert named["orphan_slots"] == 8 and sorted(named["orphan_slot_ids"]) == wanted
        assert named["idle"] is False and named["live_requests"] == 1

        engine.allocator.free(dropped)  # given back after all: the next census clears the verdict
        seen = len(rolling())
        while time.monotonic() < deadline and len(rolling()) <= seen:
            time.sleep(0.1)
        assert rolling()[-1]["orphan_slots"] == 0
    finally:
        runtime.deactivate()
    assert not [
        f for f in analyze(iter(_events(trace))).findings if f.kind == schema.ORPHAN_SLOTS and f.evidence.get("census") == "rolling"
    ]
    assert os.path.getsize(trace) > 0
