"""Hostile input, third pass (issue 52): the probe's captures, its environment, the reports' JSON, the
analysis's memory with many request ids, and the metrics' labels. Each test here failed before
its fix."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from typing import Any

import pytest

from kvdoctor.probe.readings.attribution import Attribution
from kvdoctor.probe.readings.attribution_memray import MemrayAttribution


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


# ---------------------------------------------------------------- item 3: the shutdown census wait is bounded


def test_an_infinite_shutdown_census_wait_keeps_the_default(tmp_path, monkeypatch, capsys):
    from test_shutdown_rendezvous import _engine

    from kvdoctor.probe.base import shutdown

    monkeypatch.setattr(shutdown, "DEFAULT_WAIT_S", 0.3)  # the default, made short for the test
    silent = _engine(str(tmp_path), "silent")  # registered, alive, never answers
    outcomes: list[dict] = []
    try:
        for value in ("inf", "1e300", "nan", "-1", "soon"):
            monkeypatch.setenv(shutdown.ENV_WAIT_S, value)
            waiter = threading.Thread(target=lambda: outcomes.append(shutdown.Rendezvous(str(tmp_path)).ask_and_wait()), daemon=True)
            waiter.start()
            waiter.join(timeout=30)
            assert not waiter.is_alive(), f"{shutdown.ENV_WAIT_S}={value} held the shutdown"
    finally:
        silent.kill()
        silent.wait(timeout=30)
    assert all(o["unanswered"] == [silent.pid] and o["waited_s"] < 5 for o in outcomes), outcomes
    said = [ln for ln in capsys.readouterr().err.splitlines() if shutdown.ENV_WAIT_S in ln]
    assert len(said) == 1 and "using 0.3" in said[0], said  # once per variable and process


# ---------------------------------------------------------------- item 12: one reader for every variable

PROBE_WITH_BAD_SETTINGS = textwrap.dedent(
    """
    import sys, threading, time
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang.state import sglang_state
    probe = runtime.activate(sys.argv[1])
    print("probe", probe is not None, flush=True)
    probe.emitter.emit("probe_status", {"component": "test", "state": "on", "reason": "a first write starts the writer"})
    state = sglang_state(probe)
    time.sleep(0.3)
    writers = [t for t in threading.enumerate() if t.name == "kvdoctor-writer"]
    print(probe.emitter.flush_interval_s, probe.idle_census_interval_s, state.rolling_interval_s, len(writers), flush=True)
    """
)


def test_bad_environment_values_keep_the_defaults_and_the_probe_runs(tmp_path):
    from kvdoctor.probe.ledgers.busy import ROLLING_CENSUS_INTERVAL_S

    env = {
        **os.environ,
        "KVDOCTOR_WRITER_INTERVAL_S": "1e300",  # killed the writer thread (an OverflowError in its wait)
        "KVDOCTOR_IDLE_CENSUS_INTERVAL_S": "abc",  # kept the probe from starting
        "KVDOCTOR_ROLLING_CENSUS_S": "abc",  # turned the engine's state off
        "KVDOCTOR_DISABLE": "0",  # disabled it
    }
    proc = subprocess.run(
        [sys.executable, "-c", PROBE_WITH_BAD_SETTINGS, str(tmp_path / "t.kvtrace.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in proc.stderr and proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "probe True", proc.stdout
    assert lines[1].split() == ["0.5", "2.0", f"{ROLLING_CENSUS_INTERVAL_S}", "1"], proc.stdout
    said = sorted(ln.split("=")[0] for ln in proc.stderr.splitlines() if ln.startswith("kvdoctor: KVDOCTOR_"))
    assert said == [
        "kvdoctor: KVDOCTOR_IDLE_CENSUS_INTERVAL_S",
        "kvdoctor: KVDOCTOR_ROLLING_CENSUS_S",
        "kvdoctor: KVDOCTOR_WRITER_INTERVAL_S",
    ]


@pytest.mark.parametrize("value", ["abc", "inf", "-inf", "nan", "-1", "1e300", "0x10", "   "])
def test_every_numeric_reader_keeps_its_default_for_a_bad_value(monkeypatch, capsys, value):
    from kvdoctor.probe.base import settings
    from kvdoctor.probe.engines.sglang import mamba_pool, mm_inputs, pd_decode
    from kvdoctor.probe.engines.vllm import connector
    from kvdoctor.probe.readings import memory_classes
    from kvdoctor.probe.readings.attribution import DEFAULT_TOP

    for name in ("KVDOCTOR_MM_HELD_AGE_S", "KVDOCTOR_CONNECTOR_DEADLINE_S", "KVDOCTOR_MAMBA_CENSUS_PERIOD_S",
                 "KVDOCTOR_PD_TRANSFER_DEADLINE_S", "KVDOCTOR_MEMORY_CLASSES_PERIOD_S", "KVDOCTOR_MEMORY_CLASSES_BUDGET_MS",
                 "KVDOCTOR_ATTRIBUTION_TOP"):  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(settings, "_SAID", set())
    assert mm_inputs.held_age_from_env() == mm_inputs.DEFAULT_HELD_AGE_S
    assert connector.deadline_from_env() == connector.DEFAULT_DEADLINE_S
    assert connector.wall_clock_text(connector.deadline_from_env())  # an infinite deadline made gmtime raise
    assert mamba_pool._census_period() == mamba_pool.CENSUS_PERIOD_S
    assert pd_decode._deadline() == pd_decode.DEADLINE_S
    assert memory_classes._period_s() == memory_classes.DEFAULT_PERIOD_S
    assert memory_classes._budget_ns() == int(memory_classes.DEFAULT_BUDGET_MS * 1e6)
    assert Attribution(_Probe("")).top == DEFAULT_TOP
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("kvdoctor: KVDOCTOR_")]
    assert len(said) == (0 if not value.strip() else 7), said


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("", False), ("1", True), ("yes", True), ("maybe", False)])
def test_kvdoctor_disable_is_a_switch(monkeypatch, value, on):
    from kvdoctor.probe.base import settings
    from kvdoctor.probe.core import runtime

    monkeypatch.setenv(runtime.ENV_DISABLE, value)
    monkeypatch.setattr(settings, "_SAID", set())
    assert settings.env_switch(runtime.ENV_DISABLE, False) is on


@pytest.mark.parametrize(("value", "watching"), [("0", True), ("off", True), ("", True), ("1", False), ("yes", False)])
def test_the_start_up_hook_reads_kvdoctor_disable_as_the_probe_does(value, watching):
    """The wheel's start-up hook (kvdoctor/probe/core/entry.py) is a way in of its own: KVDOCTOR_DISABLE=0
    must not keep it from watching for the engine, as it does not disable the probe."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import sys, kvdoctor.probe.core.entry as e; print(e.EngineWatch in sys.meta_path)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
    env.update(KVDOCTOR_AUTOPROBE="1", KVDOCTOR_DISABLE=value, PYTHONPATH=repo)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(watching), out.stdout + out.stderr


# ---------------------------------------------------------------- item 7: analysis memory whatever a census names

NAMED = 40_000  # request ids in each census
CENSUSES = 6  # of as many allocators, each the latest of its own


def _naming_trace(path: str) -> str:
    from kvdoctor.trace import schema
    from kvdoctor.trace.writer import TraceWriter, finish_trace

    writer = TraceWriter(path)
    header = schema.header_event(pid=7, engine="sglang", engine_version="0.5.23", process_title="sglang::scheduler", extra={})
    writer.write_batch([header])
    for n in range(CENSUSES):
        requests = {f"req-{n}-{i:07d}": 1 + (i % 3) for i in range(NAMED)}
        args = {
            "allocator": f"TokenToKVPoolAllocator#{n}",
            "reason": "exit",
            "idle": True,
            "page_size": 1,
            "live_requests": 0,
            "total_slots": 10 * NAMED,
            "free_slots": 0,
            "orphan_slots": sum(requests.values()),
            "orphan_slot_ids": list(range(NAMED)),
            "orphan_allocated_at": {"scheduler.py:100": sum(requests.values())},
            "orphan_requests": requests,
        }
        writer.write_batch([schema.Event(ph="i", name=schema.CENSUS, pid=7, ts=1e6 * (n + 1), args=args)])
    writer.close()
    finish_trace(path, 7, {"command_exit": 0})
    return path


def test_a_census_naming_many_requests_is_held_bounded_and_counted_exactly(tmp_path):
    import gc
    import json

    from kvdoctor.analysis.named import MAX_NAMED
    from kvdoctor.analysis.replay import analyze_trace
    from kvdoctor.formats.reports import render

    trace = _naming_trace(str(tmp_path / "named.kvtrace.json"))
    gc.collect()
    tracemalloc.start()
    try:
        analysis = analyze_trace(trace)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # what the analysis keeps, not what one census costs while it is read (before: every id of every census, ~25 MB)
    assert held < 4 * 1024 * 1024, held
    orphans = [f for f in analysis.findings if f.kind == "orphan_slots"]
    assert len(orphans) == CENSUSES
    total = sum(1 + (i % 3) for i in range(NAMED))
    for finding in orphans:
        assert finding.count == total  # the count stays exact
        named = finding.evidence["requests"]
        assert len(named) == MAX_NAMED and all(v == 3 for v in named.values())  # the largest are kept
        left = finding.evidence["requests_not_named"]
        assert left["entries"] == NAMED - MAX_NAMED and left["count"] + sum(named.values()) == total
        assert len(finding.evidence["slot_ids"]) <= MAX_NAMED
    for output_format in ("json", "jsonl"):
        report = render(analysis, output_format)
        assert len(report) < 200_000, (output_format, len(report))
        assert report.count("req-") <= CENSUSES * (MAX_NAMED + 1)  # the sample, and the message's top request
    json.loads(render(analysis, "json"))


def test_violations_naming_new_requests_every_time_stay_bounded():
    from kvdoctor.analysis.detectors.double_free import DoubleFreeDetector
    from kvdoctor.analysis.named import MAX_NAMED
    from kvdoctor.trace import schema

    detector = DoubleFreeDetector()
    for n in range(2_000):
        args = {"kind": detector.kind, "allocator": "a", "site": "s.py:1", "count": 2, "requests": {f"r{n}-a": 1, f"r{n}-b": 1}}
        detector.feed(schema.Event(ph="i", name=schema.VIOLATION, pid=7, ts=float(n), args=args))
    [finding] = detector.findings()
    assert finding.count == 4_000
    assert len(finding.evidence["requests"]) <= MAX_NAMED
    left = finding.evidence["requests_not_named"]
    assert left["count"] + sum(finding.evidence["requests"].values()) == 4_000


# ---------------------------------------------------------------- items 8 and 9: the metrics' processes and labels


def _memory(pid: int, title: str = "") -> Any:
    from kvdoctor.trace import schema

    return schema.Event(
        ph="C", name=schema.MEMORY_COUNTER, pid=pid, ts=1.0, args={"rss_bytes": 1024.0 * pid, "title": title or f"worker {pid}"}
    )


def _scrape(url: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""


def test_watch_metrics_drop_exited_processes_and_cap_the_live_ones():
    from kvdoctor.formats.live.prometheus import MAX_PROCESSES, PrometheusExporter

    exporter = PrometheusExporter("127.0.0.1", 0).start()
    try:
        for round_ in range(300):  # a churning tree: every round two new short-lived workers beside the root
            exporter.feed([_memory(1), _memory(1000 + 2 * round_), _memory(1001 + 2 * round_)])
        status, body = _scrape(exporter.url)
        assert status == 200
        pids = {line.split('pid="')[1].split('"')[0] for line in body.decode().splitlines() if line.startswith("kvdoctor:memory_bytes{")}
        assert pids == {"1", "1598", "1599"}, sorted(pids)[:10]  # before: every pid it ever saw (601)
        exporter.feed([_memory(pid) for pid in range(2, 2 + 3 * MAX_PROCESSES)])  # more live processes than exported
        status, body = _scrape(exporter.url)
        text = body.decode()
        assert (
            len({ln.split('pid="')[1].split('"')[0] for ln in text.splitlines() if ln.startswith("kvdoctor:memory_bytes{")})
            == MAX_PROCESSES
        )
        assert f"kvdoctor:processes_left_out {2 * MAX_PROCESSES}.0" in text
    finally:
        exporter.stop()


def test_a_lone_surrogate_in_a_title_never_fails_a_scrape():
    from kvdoctor.formats.live.prometheus import PrometheusExporter

    exporter = PrometheusExporter("127.0.0.1", 0).start()
    try:
        exporter.feed([_memory(7, "python serve.py --name \udc80x\x7f")])
        status, body = _scrape(exporter.url)
        assert status == 200, status  # before: HTTP 500 at every scrape from then on
        assert b"\\udc80x" in body
    finally:
        exporter.stop()


def test_a_lone_surrogate_in_a_title_never_fails_a_run_metrics_scrape():
    from prometheus_client import CollectorRegistry, generate_latest

    from kvdoctor.formats.live.fleet import FleetState
    from kvdoctor.formats.live.fleet_server import _Collector
    from kvdoctor.trace import schema

    state = FleetState()
    header = schema.header_event(pid=7, engine="sglang", engine_version="0.5.23", process_title="sglang::scheduler \udc80", extra={})
    state.feed([header, _memory(7, "sglang::scheduler \ud800")])
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(state))
    assert b"\\ud800" in generate_latest(registry) or b"\\udc80" in generate_latest(registry)


# ---------------------------------------------------------------- items 13 and 14: crafted values in reports and profiles


def _crafted_trace(path: str) -> str:
    """A trace as no probe writes one, by hand: a 900-deep field, a NaN, DEL and C1 characters in a
    request id, and attribution windows whose length is infinite or NaN."""
    import json

    from kvdoctor.trace import schema
    from kvdoctor.trace.writer import TraceWriter, finish_trace

    writer = TraceWriter(path)
    writer.write_batch([schema.header_event(pid=7, engine="sglang", engine_version="0.5.23", process_title="sglang::scheduler", extra={})])
    writer.close()
    violation = {
        "kind": schema.DOUBLE_FREE,
        "allocator": "TokenToKVPoolAllocator#0",
        "site": "scheduler.py:1",
        "count": 2,
        "slot_ids": [1, 2],
        "requests": {"req-\x7f-\x85-\x9b": 2},
        "ratio": math.nan,
    }
    line = json.dumps({"ph": "i", "name": schema.VIOLATION, "pid": 7, "tid": 0, "ts": 1e6, "args": violation})
    line = line[: -len("}}")] + ', "deep": ' + "[" * 900 + '"bottom"' + "]" * 900 + "}}"  # json.dumps itself would recurse
    window = {"window_index": 0, "window_s": math.inf, "top_sites": [{"file": "a.py", "line": 1, "size_diff_bytes": 10}]}
    lines = [
        line,
        json.dumps({"ph": "i", "name": schema.HOST_GROWTH_SITES, "pid": 7, "tid": 0, "ts": 2e6, "args": window}),
        json.dumps(
            {
                "ph": "i",
                "name": schema.HOST_GROWTH_SITES,
                "pid": 7,
                "tid": 0,
                "ts": 3e6,
                "args": {**window, "window_index": 1, "window_s": math.nan},
            }
        ),
    ]
    with open(path, "a") as fh:
        fh.write("".join(ln + ",\n" for ln in lines))
    finish_trace(path, 7, {"command_exit": 0})
    return path


def _replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", "replay", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("output_format", ["json", "jsonl", "text", "html"])
def test_reports_of_crafted_values_are_strict_json_and_never_an_internal_error(tmp_path, output_format):
    import json

    trace = _crafted_trace(str(tmp_path / "crafted.kvtrace.json"))
    proc = _replay(trace, "--format", output_format)
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, (output_format, proc.stderr[-2000:])
    assert proc.returncode in (0, 1), (output_format, proc.returncode)
    if output_format == "json":
        json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"{c} in the JSON report"))  # before: RecursionError
    if output_format == "jsonl":
        records = [json.loads(ln, parse_constant=lambda c: pytest.fail(f"{c} in JSONL")) for ln in proc.stdout.splitlines() if ln]
        assert records and "\\x7f" not in proc.stdout and "\\x85" not in proc.stdout  # invalid JSON escapes, before
        found = next(r for r in records if r["kind"] == "double_free")
        assert "req-\x7f-\x85-\x9b" in found["evidence"]["requests"]
        assert found["evidence"]["ratio"] is None


def test_pprof_windows_with_infinite_or_nan_times_are_written(tmp_path):
    trace = _crafted_trace(str(tmp_path / "crafted.kvtrace.json"))
    proc = _replay(trace, "--pprof", str(tmp_path / "profiles"))
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]  # before: OverflowError
    assert sorted(os.listdir(tmp_path / "profiles")) == ["pid7-window0.pb.gz", "pid7-window1.pb.gz"]


# ---------------------------------------------------------------- neighbours: values that would spin the server


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVDOCTOR_WRITER_INTERVAL_S", "1e-9"),  # the writer thread in a busy loop
        ("KVDOCTOR_ATTRIBUTION_SAMPLE_HZ", "1e9"),  # the attribution sampler taking the GIL without a pause
        ("KVDOCTOR_ATTRIBUTION_PERIOD_S", "1e-9"),  # tracemalloc windows back to back
    ],
)
def test_values_that_would_spin_a_core_keep_the_default(monkeypatch, capsys, name, value):
    from kvdoctor.probe.base import settings
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.readings import attribution

    monkeypatch.setenv(name, value)
    monkeypatch.setattr(settings, "_SAID", set())
    probe = runtime.Probe(None)
    worker = Attribution(_Probe(""))
    assert probe.emitter.flush_interval_s == 0.5
    assert worker.sample_hz == attribution.DEFAULT_SAMPLE_HZ and worker.period_s == attribution.DEFAULT_PERIOD_S
    assert [ln.split("=")[0] for ln in capsys.readouterr().err.splitlines() if "KVDOCTOR_" in ln] == [f"kvdoctor: {name}"]


def test_a_fifo_at_a_rendezvous_name_never_blocks_the_probe(tmp_path):
    from kvdoctor.probe.base import shutdown

    os.mkfifo(tmp_path / f".census.1.{os.getpid()}")
    os.mkfifo(tmp_path / f"{shutdown.WRITER_STOPPED}{os.getpid()}")
    results: list[bool] = []

    def write() -> None:
        results.append(shutdown.Rendezvous(str(tmp_path))._write("census.1", {"pid": 1}))
        os.environ[shutdown.ENV_RENDEZVOUS] = str(tmp_path)
        try:
            shutdown.note_writer_stopped("disk full")
        finally:
            del os.environ[shutdown.ENV_RENDEZVOUS]
        results.append(True)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(timeout=20)
    assert not writer.is_alive(), "the probe blocked on a FIFO in the run's directory"
    assert results == [False, True]


@pytest.mark.parametrize("detector_name", ["MmFeaturesHeldDetector", "MambaOrphanSlotsDetector", "LoraGhostUidDetector"])
def test_the_latest_count_a_detector_keeps_holds_no_list_of_ids(detector_name):
    import gc

    from kvdoctor.analysis.detectors import lora_ghost_uid, mamba_orphan_slots, mm_features_held
    from kvdoctor.trace import schema

    detector = {
        "MmFeaturesHeldDetector": (mm_features_held.MmFeaturesHeldDetector, schema.MM_INPUTS),
        "MambaOrphanSlotsDetector": (mamba_orphan_slots.MambaOrphanSlotsDetector, schema.MAMBA_POOL),
        "LoraGhostUidDetector": (lora_ghost_uid.LoraGhostUidDetector, schema.LORA_POOL),
    }[detector_name]
    sink = detector[0]()
    tracemalloc.start()
    try:
        for pid in range(1, 9):  # eight processes, each one latest event naming 50,000 requests
            args = {
                "when": "exit",
                "slots": 8,
                "released": [f"r{pid}-{i}" for i in range(50_000)],
                "waiting": {f"w{i}": 1 for i in range(50_000)},
            }
            sink.feed(schema.Event(ph="i", name=detector[1], pid=pid, ts=1.0, args=args))
            del args
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 2 * 1024 * 1024, held  # before: every id of every process's latest event (~40 MB)
