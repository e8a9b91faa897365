"""`kvdoctor gate`: judge a trace (or a command run under the probe) against budgets, for CI.

Exit codes: 0 every check passed, 1 a check failed, 2 could not judge (see kvdoctor.analysis.gate
for when an analysis cannot be judged). The verdict goes to stdout, with GitHub annotations when
run in GitHub Actions, and optionally JUnit XML and the HTML report to files.
"""

from __future__ import annotations

import os
import sys

from kvdoctor.analysis.gate import DEFAULT_FAIL_ON, DEFAULT_MAX_GROWTH, DEFAULT_TOLERANCE, Budgets, judge
from kvdoctor.errors import KvdoctorError
from kvdoctor.reporters import render
from kvdoctor.reporters.github import github_annotations, in_github_actions
from kvdoctor.reporters.junit import write_junit
from kvdoctor.runner import analyze_recorded
from kvdoctor.runner.launch import run_command
from kvdoctor.trace import schema
from kvdoctor.units import parse_rate


def _is_trace_path(args: list[str]) -> bool:
    return len(args) == 1 and args[0].endswith(".json") and os.path.isfile(args[0])


def _fail_on_kinds(fail_on: str) -> set[str]:
    kinds = {k.strip() for k in (fail_on or "").split(",") if k.strip()}
    unknown = sorted(kinds - set(schema.FINDING_KINDS))
    if unknown:
        raise KvdoctorError(
            f"--fail-on names no finding kind {', '.join(repr(k) for k in unknown)}", "choose from " + ", ".join(schema.FINDING_KINDS)
        )
    return kinds


def gate(
    command_or_trace: list[str],
    *,
    max_growth: str = DEFAULT_MAX_GROWTH,
    max_orphan_slots: int = 0,
    fail_on: str = ",".join(DEFAULT_FAIL_ON),
    junit: str | None = None,
    baseline: str | None = None,
    html: str | None = None,
    trace: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> int:
    """Judge a trace (one existing *.json path) or run a command under the probe and judge its trace."""
    if int(max_orphan_slots) < 0:
        raise KvdoctorError("--max-orphan-slots must be 0 or more")
    budgets = Budgets(
        max_growth_bytes_per_s=parse_rate(max_growth), max_orphan_slots=int(max_orphan_slots), fail_on=_fail_on_kinds(fail_on)
    )
    args = list(command_or_trace)
    if not args:
        raise KvdoctorError("nothing to judge", "usage: kvdoctor gate TRACE.json, or kvdoctor gate [OPTIONS] -- CMD ...")
    judging_a_trace = _is_trace_path(args)
    if judging_a_trace and trace is not None:
        raise KvdoctorError(
            "--trace says where a command's trace goes, but gate was given a trace to judge",
            "drop --trace, or run a command: kvdoctor gate --trace PATH -- CMD ...",
        )
    baseline_analysis = analyze_recorded(baseline) if baseline else None
    command_code = None
    if judging_a_trace:
        trace_path = args[0]
    else:
        command_code, trace_path = run_command(args, trace, [])
    analysis = analyze_recorded(trace_path)
    result = judge(analysis, budgets, baseline_analysis, tolerance)
    if command_code is not None:
        print(f"kvdoctor gate: command exited {command_code}; trace {trace_path}")
    print("\n".join(result.summary_lines()))
    for line in github_annotations(result) if in_github_actions() else []:
        print(line)
    if junit:
        write_junit(result, junit)
    if html:
        with open(html, "w", encoding="utf-8") as fh:
            fh.write(render(analysis, "html"))
    sys.stdout.flush()
    return result.exit_code
