"""Hostile input, third pass (issue 52): the probe's captures, its environment, the reports' JSON, the
analysis's memory with many request ids, and the metrics' labels. Each test here failed before
its fix."""

from __future__ import annotations

import os
import tracemalloc

from kvdoctor.probe.attribution import Attribution
from kvdoctor.probe.attribution_memray import MemrayAttribution


class _Probe:
    """What an attribution worker reads of its probe: where the trace is."""

    def __init__(self, trace_path: str) -> None:
        self.trace_path = trace_path


def _in_child(work) -> None:
    """Runs `work()` in a forked child (a second process of the same run) and waits for it."""
    pid = os.fork()
    if pid == 0:
        try:
            work()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


# ---------------------------------------------------------------- item 15: one name per capture and process


def test_memray_captures_of_two_processes_never_share_a_name(tmp_path):
    trace = str(tmp_path / "run.kvtrace.json")

    def keep(text: str) -> None:
        capture = tmp_path / f"scratch-{os.getpid()}.bin"
        capture.write_text(text)
        MemrayAttribution(_Probe(trace))._keep(str(capture), True)

    _in_child(lambda: keep("child"))
    keep("parent")
    kept = sorted(p for p in os.listdir(tmp_path) if p.startswith("run.kvtrace.json.memray."))
    assert len(kept) == 2, kept
    assert sorted((tmp_path / name).read_text() for name in kept) == ["child", "parent"]
    assert any(name.endswith(f".memray.{os.getpid()}.0") for name in kept)


def test_a_capture_never_replaces_what_is_at_its_name(tmp_path):
    trace = str(tmp_path / "run.kvtrace.json")
    victim = tmp_path / "victim"
    victim.write_text("mine")
    os.symlink(victim, f"{trace}.memray.{os.getpid()}.0")
    capture = tmp_path / "scratch.bin"
    capture.write_text("capture")
    kept = MemrayAttribution(_Probe(trace))._keep(str(capture), True)
    assert kept == f"{trace}.memray.{os.getpid()}.1" and open(kept).read() == "capture"
    assert victim.read_text() == "mine" and os.path.islink(f"{trace}.memray.{os.getpid()}.0")


def test_tracemalloc_snapshots_of_two_processes_never_share_a_name(tmp_path):
    trace = str(tmp_path / "run.kvtrace.json")
    tracemalloc.start()
    try:
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    _in_child(lambda: Attribution(_Probe(trace))._dump(snapshot))
    Attribution(_Probe(trace))._dump(snapshot)
    dumped = sorted(p for p in os.listdir(tmp_path) if ".tracemalloc." in p)
    assert len(dumped) == 2 and not any("partial" in p for p in dumped), dumped
