"""Host growth attribution: a real child whose named thread grows a list of bytes objects."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import tracemalloc

from conftest import REPO, trace_events

from kvdoctor.analysis.detectors.host_growth_attribution import HostGrowthAttributionDetector
from kvdoctor.analysis.findings import INFO, WARNING
from kvdoctor.trace import schema

GROWER = textwrap.dedent(
    """
    import threading, time
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.readings import attribution_start
    held = []
    def back_up():
        while True:
            held.append(bytes(256 * 1024))   # GROWING LINE
            time.sleep(0.01)
    def idle():
        while True:
            time.sleep(0.01)
    threading.Thread(target=back_up, name="storage-backup", daemon=True).start()
    threading.Thread(target=idle, name="idle-worker", daemon=True).start()
    probe = runtime.activate()
    attribution_start.start_if_enabled(probe)
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_growth_is_named_by_thread_and_line_in_a_real_child(tmp_path):
    trace = str(tmp_path / "attr.kvtrace.json")
    script = tmp_path / "grower.py"
    script.write_text(GROWER)
    growing_line = GROWER.splitlines().index(next(ln for ln in GROWER.splitlines() if "GROWING LINE" in ln)) + 1
    env = dict(
        os.environ,
        KVDOCTOR_TRACE=trace,
        KVDOCTOR_ATTRIBUTION="1",
        KVDOCTOR_ATTRIBUTION_PERIOD_S="1.5",
        KVDOCTOR_ATTRIBUTION_WINDOW_S="1.0",
        PYTHONPATH=REPO,
    )
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 15
        events = []
        while time.monotonic() < deadline and not events:
            time.sleep(0.3)
            events = trace_events(trace, "host_growth_sites")
    finally:
        child.kill()
        child.wait()
    assert events, "no host_growth_sites event within 15 s"
    args = events[0]["args"]
    top = args["top_sites"][0]
    assert top["file"] == str(script) and top["line"] == growing_line
    assert top["thread"] == "storage-backup" and top["size_diff_bytes"] > 1 << 20 and top["count_diff"] > 0
    assert args["by_thread"][0]["thread"] == "storage-backup"
    assert "torch tensor storage" in args["not_seen"] and args["torch_tensors"]["counted"] is False
    assert args["snapshots"] and all(os.path.exists(p) for p in args["snapshots"])
    after, before = (tracemalloc.Snapshot.load(p) for p in args["snapshots"][::-1][:2])
    assert after.compare_to(before, "lineno")[0].size_diff > 0  # diffable outside the server
    statuses = [e["args"] for e in trace_events(trace, "probe_status") if e["args"].get("component") == "attribution"]
    assert statuses and statuses[0]["state"] == "on"

    detector = HostGrowthAttributionDetector()
    for raw in events:
        detector.feed(schema.Event.from_json_dict(raw))
    [finding] = detector.findings()
    assert f"thread storage-backup at {top['site']}" in finding.message and finding.severity in (INFO, WARNING)


def test_attribution_is_off_unless_asked(monkeypatch):
    from kvdoctor.probe.readings import attribution_start

    monkeypatch.delenv("KVDOCTOR_ATTRIBUTION", raising=False)

    class FakeProbe:
        trace_path = None

    assert attribution_start.start_if_enabled(FakeProbe()) is False


def test_a_failure_becomes_a_probe_status_event_not_an_exception():
    from kvdoctor.probe.readings import attribution

    emitted = []

    class Emitter:
        def emit(self, name, args):
            emitted.append((name, args))

    class BrokenProbe:
        emitter = Emitter()
        trace_path = None

    worker = attribution.Attribution(BrokenProbe())
    worker.window = lambda: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
    worker._run()
    assert emitted[-1][0] == "probe_status" and emitted[-1][1]["component"] == "attribution" and "boom" in emitted[-1][1]["reason"]


def test_the_detector_stays_quiet_below_its_threshold():
    detector = HostGrowthAttributionDetector()
    detector.feed(
        schema.Event(
            ph="i", name="host_growth_sites", pid=3, args={"growth_bytes": 1000, "top_sites": [{"site": "a.py:1", "size_diff_bytes": 1000}]}
        )
    )
    assert detector.findings() == []
