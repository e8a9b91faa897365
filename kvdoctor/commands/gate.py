"""`kvdoctor gate`: judge a trace (or a command run under the probe) against budgets, for CI.

Exit codes: 0 every check passed, 1 a check failed, 2 could not judge. "Could not judge" means
the analysis has no events, or no process in it was ever probed or sampled: only the run header
of `kvdoctor run` is there (no probe header with an engine, no memory/KV counters, no findings),
which is what a command that never started Python, or never imported SGLang with the probe, leaves
behind. Passing such a run would be a false green, so it is neither pass nor fail.
"""

from __future__ import annotations

import os
import sys

from kvdoctor.analysis.gate import DEFAULT_FAIL_ON, DEFAULT_MAX_GROWTH, Budgets, judge
from kvdoctor.errors import KvdoctorError
from kvdoctor.reporters.github import github_annotations, in_github_actions
from kvdoctor.reporters.junit import write_junit
from kvdoctor.units import parse_rate


def _is_trace_path(args: list[str]) -> bool:
    return len(args) == 1 and args[0].endswith(".json") and os.path.isfile(args[0])


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
    tolerance: float = 0.2,
) -> int:
    """Judge a trace (one existing *.json path) or run a command under the probe and judge its trace."""
    from kvdoctor.runner import analyze_recorded as analyze_trace

    if int(max_orphan_slots) < 0:
        raise KvdoctorError("--max-orphan-slots must be 0 or more")
    budgets = Budgets(
        max_growth_bytes_per_s=parse_rate(max_growth),
        max_orphan_slots=int(max_orphan_slots),
        fail_on={k.strip() for k in (fail_on or "").split(",") if k.strip()},
    )
    args = list(command_or_trace)
    if not args:
        raise KvdoctorError("nothing to judge", "usage: kvdoctor gate TRACE.json, or kvdoctor gate [OPTIONS] -- CMD ...")
    baseline_analysis = analyze_trace(baseline) if baseline else None
    if _is_trace_path(args):
        trace_path = args[0]
        command_code = None
    else:
        from kvdoctor.commands.run import run_command

        command_code, trace_path = run_command(args, trace, [])
    analysis = analyze_trace(trace_path)
    result = judge(analysis, budgets, baseline_analysis, tolerance)
    if command_code is not None:
        print(f"kvdoctor gate: command exited {command_code}; trace {trace_path}")
    print("\n".join(result.summary_lines()))
    if in_github_actions():
        for line in github_annotations(result):
            print(line)
    if junit:
        write_junit(result, junit)
    if html:
        from kvdoctor.reporters.html import render_html

        with open(html, "w", encoding="utf-8") as fh:
            fh.write(render_html(analysis))
    sys.stdout.flush()
    return result.exit_code
