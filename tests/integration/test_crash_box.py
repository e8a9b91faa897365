"""A process that dies right after a rule is broken still has it named: the ledger's crash box.

The case on an H200 (2026-12-02): kvdoctor's check counted a planted out-of-range `last_loc` on
SGLang 0.5.23's scheduler, whose own store kernel then asserted and aborted the process before the
writer thread's next round: the trace named nothing. Here the demo's real-SGLang workload plants a
fault under `kvdoctor run` and aborts at once (the writer's rounds a minute apart, so it has never
written): `run` must read the counts from the crash box into the trace, once, with the site; a
clean exit must not add any; and with the box switched off the abort loses them (the case tests
something).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SUPPORT, sglang_env

sys.path.insert(0, SUPPORT)

from servers import replay

CASES = os.path.join(SUPPORT, "crash_box_cases.py")


def run(tmp_path, mode: str, page_size: int, fault: str, **env: str) -> tuple[subprocess.CompletedProcess, str, dict]:
    trace = str(tmp_path / f"{mode}-{fault}-{page_size}.kvtrace.json")
    environ = {k: v for k, v in sglang_env("0.5.23").items() if not k.startswith("KVDOCTOR_")}
    temp = tmp_path / "tmp"  # the run's directory is made here: what it leaves is this run's alone
    temp.mkdir(exist_ok=True)
    environ.update(KVDOCTOR_WRITER_INTERVAL_S="600", TMPDIR=str(temp), **env)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdoctor.cli",
            "run",
            "--trace",
            trace,
            "--sample-interval",
            "0",
            "--",
            sys.executable,
            CASES,
            mode,
            str(page_size),
            fault,
        ],
        env=environ,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, (proc.returncode, proc.stderr[-3000:])
    return proc, trace, json.loads(lines[0])


def named(trace: str, kind: str) -> list[dict]:
    _rc, report = replay(trace)
    return [f for f in report["findings"] if f["kind"] == kind]


def violations(trace: str) -> list[dict]:
    with open(trace) as fh:
        events = [json.loads(line.strip().rstrip(",")) for line in fh if '"violation"' in line and line.strip().startswith("{")]
    return [e for e in events if e.get("name") == "violation"]


@pytest.mark.parametrize("page_size,fault,kind", [(1, "double-free", "double_free"), (4, "index-out-of-range", "index_out_of_range")])
def test_an_abort_right_after_the_fault_still_names_it(tmp_path, page_size, fault, kind):
    proc, trace, child = run(tmp_path, "abort", page_size, fault)
    assert proc.returncode == 128 + 6, proc.stderr[-2000:]  # SIGABRT
    planted = child["planted"][kind]
    (event,) = [e for e in violations(trace) if e["args"]["kind"] == kind]
    assert event["pid"] == child["pid"] and event["args"]["recovered"].startswith("counted at a hooked call")
    assert f"pid {child['pid']} ended before writing what its ledger had counted" in proc.stderr
    (finding,) = named(trace, kind)
    assert finding["count"] == planted, (finding, planted)
    assert "workload.py" in finding["evidence"]["site"], finding["evidence"]  # the demo's own call, by name
    if kind == "index_out_of_range":
        assert finding["evidence"]["bad_index"] < 0 or finding["evidence"]["bad_index"] >= finding["evidence"]["valid_rows"][1]
    else:
        assert finding["evidence"]["slot_ids"], finding["evidence"]
    assert os.listdir(tmp_path / "tmp") == []  # the run's directory went, boxes and all


def test_a_clean_exit_adds_nothing_to_what_the_writer_wrote(tmp_path):
    proc, trace, child = run(tmp_path, "exit", 1, "double-free")
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [e for e in violations(trace) if e["args"]["kind"] == "double_free"]
    assert events and not any("recovered" in e["args"] for e in events), events
    (finding,) = named(trace, "double_free")
    assert finding["count"] == child["planted"]["double_free"]
    assert "crash box" not in proc.stderr
    with open(trace) as fh:
        ledgers = [json.loads(line.strip().rstrip(",")) for line in fh if '"ledger for ' in line]
    assert ledgers and all(e["args"]["crash_box"] == "on" for e in ledgers), ledgers  # the box was there, and said so


def test_without_the_box_an_abort_loses_the_finding(tmp_path):
    proc, trace, _child = run(tmp_path, "abort", 1, "double-free", KVDOCTOR_CRASH_BOX="0")
    assert proc.returncode == 128 + 6
    assert violations(trace) == [] and named(trace, "double_free") == []
