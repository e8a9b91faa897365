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
from xml.sax.saxutils import escape as _xml_escape, quoteattr as _xml_attr

from kvdoctor.analysis.gate import DEFAULT_FAIL_ON, DEFAULT_MAX_GROWTH, Budgets, GateResult, judge
from kvdoctor.errors import KvdoctorError
from kvdoctor.units import parse_rate


def write_junit(result: GateResult, path: str) -> None:
    failures = len(result.failed) if result.judged else 0
    errors = 0 if result.judged else 1
    tests = len(result.checks) + errors
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f'<testsuites name="kvdoctor" tests="{tests}" failures="{failures}" errors="{errors}">',
             f'  <testsuite name="kvdoctor-gate" tests="{tests}" failures="{failures}" errors="{errors}" skipped="0">']
    for check in result.checks:
        lines.append(f'    <testcase classname="kvdoctor-gate" name={_xml_attr(check.name)}>')
        if check.passed:
            lines.append(f"      <system-out>{_xml_escape(check.detail)}</system-out>")
        else:
            lines.append(f'      <failure message={_xml_attr(check.detail)} type="budget">{_xml_escape(check.detail)}</failure>')
        lines.append("    </testcase>")
    if not result.judged:
        lines.append('    <testcase classname="kvdoctor-gate" name="judge">')
        lines.append(f'      <error message={_xml_attr(result.reason)} type="could-not-judge">{_xml_escape(result.reason)}</error>')
        lines.append("    </testcase>")
    lines += ["  </testsuite>", "</testsuites>", ""]
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))


def _annotation_text(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def github_annotations(result: GateResult) -> list[str]:
    if not result.judged:
        return [f"::error title=kvdoctor gate::could not judge: {_annotation_text(result.reason)}"]
    return [f"::error title=kvdoctor gate::{_annotation_text(c.name + ': ' + c.detail)}" for c in result.failed]


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
    if os.environ.get("GITHUB_ACTIONS") == "true":
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
