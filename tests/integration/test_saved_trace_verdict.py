"""A saved trace is judged exactly as the live run was (`kvdoctor run --trace T -- CMD`, then
`kvdoctor gate T`, docs/ci-gate.md's "Judge a trace later"): the trace carries the command's exit status,
so a run that failed, or whose command no probe reported from, fails the gate later too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace

CLEAN = "from kvdoctor.demo.workload import WorkloadConfig, run_workload; run_workload(WorkloadConfig(fault='none', turns=2))"


def kv(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def run_then_gate(tmp_path, *command: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    trace = str(tmp_path / "saved.kvtrace.json")
    ran = kv("run", "--trace", trace, "--", *command, cwd=tmp_path)
    later = kv("gate", trace, cwd=tmp_path)
    live = kv("gate", "--force", "--trace", str(tmp_path / "live.kvtrace.json"), "--", *command, cwd=tmp_path)
    return ran, later, live


def test_a_saved_trace_of_a_failed_command_fails_the_gate(tmp_path):
    ran, later, live = run_then_gate(tmp_path, "false")
    assert ran.returncode == 1
    assert later.returncode == live.returncode == 1, later.stdout
    assert "FAIL  command-exit: the command exited 1: a failed run is not a pass" in later.stdout
    assert "kvdoctor gate: the command in the trace exited 1" in later.stdout


def test_a_saved_trace_of_an_unprobed_command_fails_the_gate(tmp_path):
    ran, later, live = run_then_gate(tmp_path, sys.executable, "-c", "pass")
    assert ran.returncode == 0
    assert later.returncode == live.returncode == 1, later.stdout
    assert "FAIL  probe-reported: no probe reported from an engine" in later.stdout


def test_a_saved_trace_of_a_clean_probed_run_is_judged_as_the_live_run_was(tmp_path):
    """A clean run of a few seconds: every budget holds but growth, which so little data after the
    start-up cannot judge (2, never a pass), later as live."""
    ran, later, live = run_then_gate(tmp_path, sys.executable, "-c", CLEAN)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert later.returncode == live.returncode == 2, later.stdout + live.stdout
    assert "PASS  command-exit: the command exited 0" in later.stdout
    assert [line.split(":")[0].strip() for line in later.stdout.splitlines() if line.startswith("  ") and "PASS" not in line] == [
        "N/A   max-growth"
    ], later.stdout
    strip = lambda out: [line for line in out.splitlines() if "trace" not in line and "pid" not in line]
    assert strip(later.stdout) == strip(live.stdout)


@pytest.mark.parametrize("count", [float("nan"), float("inf"), "1e3", -5, True], ids=["nan", "inf", "string", "negative", "bool"])
def test_a_census_whose_orphan_count_is_damaged_is_no_verdict(tmp_path, count):
    """A census of a probed engine whose orphan count is not a count never reads as 0 orphans:
    the gate cannot judge (2), whatever clean census came before it."""
    path = str(tmp_path / "damaged.kvtrace.json")
    writer = TraceWriter(path)
    census = {"allocator": "A#0", "reason": "idle", "idle": True, "orphan_slots": 0}
    writer.write_batch(
        [
            schema.header_event(
                pid=7, engine="sglang", engine_version="0.5.23", process_title="sglang::scheduler", extra={"probe": "kvdoctor"}
            ),
            schema.Event(ph="i", name=schema.CENSUS, pid=7, ts=1e6, args=census),
            schema.Event(ph="i", name=schema.CENSUS, pid=7, ts=2e6, args={**census, "reason": "exit", "orphan_slots": count}),
        ]
    )
    writer.close()
    finish_trace(path, 7)
    proc = kv("gate", path, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert "a census in the trace is damaged" in proc.stdout and "orphan count is unreadable" in proc.stdout


def test_the_json_report_is_strict_json_whatever_a_finding_carries():
    """A finding whose evidence holds a NaN or an infinity (a detector reading a damaged number)
    comes out as null: JavaScript's JSON.parse and jq reject `NaN`/`Infinity`."""
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.analysis.findings import ERROR, Finding
    from kvdoctor.formats.reports import render

    analysis = analyze(iter([]))
    odd = {"ratio": float("nan"), "per_s": [float("inf"), 1.5], "nested": {"low": float("-inf")}}
    analysis.findings.append(Finding("double_free", ERROR, "a finding", 1, odd, 7))
    text = render(analysis, "json")
    report = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON report"))
    assert report["findings"][-1]["evidence"] == {"ratio": None, "per_s": [None, 1.5], "nested": {"low": None}}


def test_a_trace_saved_under_another_name_is_judged_not_run(tmp_path):
    """`gate run.kvtrace` (no .json) judges the trace; it used to be taken for a command ("command
    not found"). A file that is not a trace is still taken as a command."""
    path = str(tmp_path / "run.kvtrace")
    writer = TraceWriter(path)
    writer.write_batch(
        [schema.header_event(pid=7, engine="sglang", engine_version="0.5.23", process_title="x", extra={"probe": "kvdoctor"})]
    )
    writer.close()
    finish_trace(path, 7)
    proc = kv("gate", path, cwd=tmp_path)
    assert "command not found" not in proc.stderr and f"kvdoctor gate: {path}" in proc.stdout, proc.stdout + proc.stderr
    other = tmp_path / "notes.txt"
    other.write_text("not a trace\n")
    proc = kv("gate", str(other), cwd=tmp_path)
    assert proc.returncode == 2 and f"{other} is neither a kvdoctor trace nor an executable command" in proc.stderr


# --------------------------------------------------------------------------- a record that stops early (#27 item 6)

S = 1_000_000.0  # microseconds


def _probe_header(pid: int) -> schema.Event:
    return schema.header_event(
        pid=pid, engine="sglang", engine_version="0.5.23", process_title=f"sglang::scheduler_TP{pid}", extra={"probe": "kvdoctor"}
    )


def _run_header(pid: int = 100) -> schema.Event:
    header = schema.header_event(pid=pid, engine="", engine_version="", process_title="kvdoctor run -- python -m sglang.launch_server")
    header.name = schema.RUN_HEADER
    return header


def _census(pid: int, ts: float, orphans: int = 0) -> schema.Event:
    args = {"allocator": "TokenToKVPoolAllocator#0", "reason": "idle", "idle": True, "total_slots": 2048}
    args.update(free_slots=2048 - orphans, owned_slots=orphans, tree_slots=0, orphan_slots=orphans, orphan_slot_ids=list(range(orphans)))
    return schema.Event(ph="i", name=schema.CENSUS, pid=pid, ts=ts, cat=schema.CAT_PROBE, args=args)


def _slots(pid: int, ts: float, owned: int) -> schema.Event:
    args = {"allocator": "TokenToKVPoolAllocator#0", "total_slots": 2048, "free_slots": 2048 - owned, "owned_slots": owned}
    args.update(tree_slots=0, tree_freed_slots=0, unaccounted_slots=0)
    return schema.Event(ph="C", name=schema.LEDGER_COUNTER, pid=pid, ts=ts, cat=schema.CAT_PROBE, args=args)


def _stats(pid: int, ts: float, dropped: int = 0, write_error: str = "") -> schema.Event:
    args = {"hooked_calls": 10, "probe_failures": 0, "buffered": 0, "dropped_events": dropped, "written_events": 5}
    args.update(written_bytes=100, write_error=write_error, time_s=ts / S)
    return schema.Event(ph="C", name=schema.PROBE_STATS, pid=pid, ts=ts, cat=schema.CAT_PROBE, args=args)


def _turned_off(pid: int, ts: float) -> schema.Event:
    reason = "RuntimeError in the free hook: boom; the server's calls go on untouched, ledger findings stop here"
    return schema.Event(
        ph="i",
        name=schema.PROBE_STATUS,
        pid=pid,
        ts=ts,
        cat=schema.CAT_PROBE,
        args={"component": "ledger", "state": "off", "reason": reason},
    )


def _clean_start(pid: int = 7) -> list[schema.Event]:
    """A scheduler that served (its ledger held slots) and was counted whole by a clean census."""
    return [_probe_header(pid), _slots(pid, 1 * S, 10), _stats(pid, 1.5 * S), _census(pid, 2 * S)]


def _damaged_header(pid: int) -> schema.Event:
    header = _probe_header(pid)
    header.args["engine"] = 5
    del header.args["probe"]
    return header


STOPPED_EARLY = {
    "a second scheduler that held 500 slots and was never counted": (
        _clean_start(7) + [_probe_header(8), _slots(8, 1 * S, 500), _slots(8, 3 * S, 500)],
        "pid 8 TokenToKVPoolAllocator#0: its ledger held up to 500 slot(s) and no census counted it",
    ),
    "the probe turned itself off after a clean census": (
        _clean_start() + [_turned_off(7, 3 * S)],
        "pid 7: the probe turned itself off 1.0 s after its last census (RuntimeError in the free hook",
    ),
    "250k events dropped after a clean census": (
        _clean_start() + [_stats(7, 3 * S, dropped=250_000)],
        "pid 7: it dropped 250000 trace event(s) (the writer fell behind)",
    ),
    "the writer stopped by a full disk after a clean census": (
        _clean_start() + [_stats(7, 3 * S, write_error="OSError: [Errno 28] No space left on device")],
        "pid 7: it stopped writing its trace (OSError: [Errno 28] No space left on device)",
    ),
}


def _write_trace(path: str, events: list[schema.Event]) -> str:
    writer = TraceWriter(path)
    writer.write_batch(events)
    writer.close()
    finish_trace(path, events[0].pid)
    return path


@pytest.mark.parametrize("case", list(STOPPED_EARLY))
def test_a_record_that_stops_early_cannot_vouch_for_the_end(tmp_path, case):
    """A clean census early on, then the record stops (or a ledger was never counted): "could not
    judge" (2) with the reason, never a pass with warnings."""
    events, reason = STOPPED_EARLY[case]
    path = _write_trace(str(tmp_path / "stopped.kvtrace.json"), events)
    proc = kv("gate", path, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert "kvdoctor gate: COULD NOT JUDGE (" in proc.stdout and reason in proc.stdout, proc.stdout


def _flat_memory(pid: int, seconds: int = 20) -> list[schema.Event]:
    """What the sampler records of a process whose memory holds flat: enough for the growth
    budget to be judged held (with fewer samples it is "not judged", never a pass)."""
    return [
        schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=pid, ts=i * S, cat=schema.CAT_SAMPLER, args={"rss_bytes": 1 << 30})
        for i in range(seconds)
    ]


def test_the_same_records_reaching_the_end_pass(tmp_path):
    """The control: both schedulers counted, nothing dropped, no write error, the probe on to the end."""
    events = _clean_start(7) + [_probe_header(8), _slots(8, 1 * S, 500), _census(8, 3 * S), _stats(7, 3 * S)]
    events += _flat_memory(7) + _flat_memory(8)
    proc = kv("gate", _write_trace(str(tmp_path / "whole.kvtrace.json"), events), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "PASS  probe-complete: every probe's record reaches the end (2 processes)" in proc.stdout


@pytest.mark.parametrize("header", ["missing", "damaged"])
def test_a_missing_or_damaged_probe_header_is_no_pass(tmp_path, header):
    """Replay finds the 9 orphans of a process whose probe header is missing or damaged; the gate
    used to pass it ("no probed process"). It now cannot judge it, and says why."""
    events = [_run_header()] + ([_damaged_header(7)] if header == "damaged" else []) + [_slots(7, 1 * S, 9), _census(7, 2 * S, orphans=9)]
    path = _write_trace(str(tmp_path / "headless.kvtrace.json"), events)
    replayed = kv("replay", path, cwd=tmp_path)
    assert replayed.returncode == 1 and "ERROR orphan_slots x9" in replayed.stdout, replayed.stdout
    proc = kv("gate", path, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout
    assert "pid 7: it wrote probe events but its probe header is missing or damaged" in proc.stdout
    assert "N/A   max-orphan-slots: probe events without a readable probe header (pid 7)" in proc.stdout


def test_an_unreadable_line_in_the_trace_is_no_pass(tmp_path):
    """A damaged line could have been a violation or the census: the gate cannot vouch for the run."""
    path = _write_trace(str(tmp_path / "damaged.kvtrace.json"), _clean_start() + [_stats(7, 3 * S)])
    with open(path) as fh:
        lines = fh.readlines()
    lines.insert(3, '{"ph": "i", "name": "violation", "pid": 7, "args": {"kind": "double_fr\n')
    with open(path, "w") as fh:
        fh.writelines(lines)
    proc = kv("gate", path, cwd=tmp_path)
    assert proc.returncode == 2 and "the trace: 1 line(s) could not be read" in proc.stdout, proc.stdout


STOPS_WRITING = textwrap.dedent(
    """
    import json, os, resource, time
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    trace = os.environ["KVDOCTOR_TRACE"]
    run_workload(WorkloadConfig(fault="none", turns=2))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the clean idle census is in the trace
        with open(trace) as fh:
            if any('"name":"census"' in line and f'"pid":{os.getpid()},' in line for line in fh):
                break
        time.sleep(0.1)
    # from here on the file may not grow in this process: its trace writer fails, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(trace), resource.RLIM_INFINITY))
    run_workload(WorkloadConfig(fault="leak", turns=2))
    """
)


def test_a_writer_that_really_stops_is_no_pass(tmp_path):
    """A real writer failure (the file size limit of the command's own process, as a full disk
    does it) after a clean census: the trace cannot say it, so the probe leaves word in the run's
    directory and `run` puts it in the end event. The gate used to pass on the early census."""
    trace = str(tmp_path / "stopped.kvtrace.json")
    live = kv("gate", "--trace", trace, "--", sys.executable, "-c", STOPS_WRITING, cwd=tmp_path)
    assert live.returncode == 2, live.stdout + live.stderr[-2000:]
    assert "it stopped writing its trace (OSError: [Errno 27] File too large)" in live.stdout, live.stdout
    later = kv("gate", trace, cwd=tmp_path)
    assert later.returncode == 2 and "it stopped writing its trace" in later.stdout, later.stdout
    replayed = kv("replay", trace, cwd=tmp_path)
    assert "stopped writing its trace (OSError: [Errno 27] File too large): what it did after that is not in the trace" in replayed.stdout


def test_a_trace_with_no_slot_ledger_passes_on_memory_alone_and_says_the_orphan_check_does_not_apply(tmp_path):
    """A sidecar's trace of a process no probe was in: memory is judged, and the orphan budget is
    not counted among the checks that held (it used to read "PASS  max-orphan-slots: no probed
    process", a pass on nothing judged)."""
    plain = schema.header_event(pid=7, engine="", engine_version="", process_title="python3 bench.py")
    path = _write_trace(str(tmp_path / "sidecar.kvtrace.json"), [plain, *_flat_memory(7)])
    proc = kv("gate", path, cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert "  N/A   max-orphan-slots: not applicable: no probed process, so no slot ledger to judge" in lines, proc.stdout
    assert not any(line.startswith("  PASS  max-orphan-slots") for line in lines), proc.stdout
    verdict = lines[-1]
    assert verdict.startswith("kvdoctor gate: PASS (") and verdict.endswith(", 1 not applicable: max-orphan-slots)"), proc.stdout
    assert proc.returncode == 0, proc.stdout
    junit = str(tmp_path / "gate.xml")
    assert kv("gate", "--junit", junit, path, cwd=tmp_path).returncode == 0
    cases = {case.get("name"): case for case in ET.parse(junit).getroot().iter("testcase")}
    assert cases["max-orphan-slots"].find("skipped") is not None, open(junit).read()
