"""A saved trace is judged exactly as the live run was (`kvdoctor run --trace T -- CMD`, then
`kvdoctor gate T`, the README's "judge a trace later"): the trace carries the command's exit status,
so a run that failed, or whose command no probe reported from, fails the gate later too."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_a_saved_trace_of_a_clean_probed_run_passes_as_the_live_run_did(tmp_path):
    ran, later, live = run_then_gate(tmp_path, sys.executable, "-c", CLEAN)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert later.returncode == live.returncode == 0, later.stdout + live.stdout
    assert "PASS  command-exit: the command exited 0" in later.stdout
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
    from kvdoctor.reporters import render

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
    assert proc.returncode == 2 and "command not found" in proc.stderr
