"""What a person reads at the end of a command: a probe's state is no count, and kvdoctor's own
bug can be shown with its traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from kvdoctor.analysis.replay import analyze_trace
from kvdoctor.formats.reports import render
from kvdoctor.trace import schema

GPU_REPORTS = os.path.join(REPO, "tests", "integration", "data", "gpu")  # two traces the GPU machine recorded


@pytest.mark.parametrize(
    "trace,status,counted",
    [
        ("hicache_memray.trace.json", schema.PROBE_PARTIAL, f"{schema.RETAINED_VIEW} x3759 tensors: "),
        ("ll_oor_nofix.trace.json", schema.PROBE_OFF, f"{schema.INDEX_OUT_OF_RANGE} x13 indices: "),
    ],
)
def test_a_status_finding_prints_without_a_count(trace, status, counted):
    """Traces from the GPU machine: a part of the probe that turned itself off (memory classes,
    over its cost), and a probe off after a CUDA launch failure. Their findings count nothing
    (0), and "probe_off x0" read as "the probe was off zero times"; the other findings keep theirs."""
    lines = render(analyze_trace(os.path.join(GPU_REPORTS, trace)), "text").splitlines()
    status_lines = [line for line in lines if f" {status}" in line.split(":", 1)[0]]
    assert len(status_lines) == 1 and status_lines[0].startswith(f"warn  {status}: "), status_lines
    assert any(counted in line for line in lines), lines
    assert not any(" x0:" in line for line in lines), lines


def _replay_in_a_removed_directory(tmp_path, *options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`replay -o report.json` from a working directory removed before kvdoctor starts: the
    relative output path has no directory to resolve against, an error kvdoctor does not yet
    turn into its own one line, so it is an internal error (exit 2)."""
    trace = os.path.join(GPU_REPORTS, "ll_oor_nofix.trace.json")
    gone = tmp_path / "gone"
    gone.mkdir()
    return subprocess.run(
        [sys.executable, "-m", "kvdoctor", *options, "replay", trace, "-o", "report.json"],
        capture_output=True,
        text=True,
        cwd=gone,
        preexec_fn=lambda: os.rmdir(gone),  # after the child's chdir: it runs in a directory that is gone
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_an_internal_error_is_one_line_that_says_how_to_see_its_traceback(tmp_path):
    proc = _replay_in_a_removed_directory(tmp_path, env={"KVDOCTOR_DEBUG": ""})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("kvdoctor: internal error: FileNotFoundError: ")
    assert "KVDOCTOR_DEBUG=1 or --debug prints its traceback" in lines[0]


@pytest.mark.parametrize("how", ["KVDOCTOR_DEBUG=1", "--debug"])
def test_debugging_prints_the_traceback_of_an_internal_error(tmp_path, how):
    if how == "--debug":
        proc = _replay_in_a_removed_directory(tmp_path, "--debug", env={"KVDOCTOR_DEBUG": ""})
    else:
        proc = _replay_in_a_removed_directory(tmp_path, env={"KVDOCTOR_DEBUG": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and lines[0] == "Traceback (most recent call last):", proc.stderr
    assert any("kvdoctor/outputs.py" in line and "claim_output" in line for line in lines), proc.stderr  # where it was raised
    assert lines[-1].startswith("kvdoctor: internal error: FileNotFoundError: ") and "traceback above" in lines[-1]
