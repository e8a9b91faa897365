"""`kvdoctor gate`: judge a trace (or a command run under the probe) against budgets, for CI.

Exit codes: 0 every check passed, 1 a check failed (the command's own failure included), 2 could
not judge (see kvdoctor.analysis.gate). The verdict goes to stdout, with GitHub annotations when
run in GitHub Actions, and optionally JUnit XML and the HTML report to files (0600); a file that
cannot be written is said on stderr and never turns a failure into anything else.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any

from kvdoctor.analysis.budgets import ANY_ENGINE, DEFAULT_FAIL_ON, DEFAULT_MAX_GROWTH, ENGINE_CHOICES, GROWTH_OFF, Budgets, finding_kinds
from kvdoctor.analysis.gate import check_baseline_engines, judge
from kvdoctor.analysis.growth import DEFAULT_MIN_RATE_BYTES_PER_S, GrowthParams
from kvdoctor.delivery.launch import interpreter_of, run_command
from kvdoctor.errors import EXIT_UNUSABLE, KvdoctorError, TraceError
from kvdoctor.formats.reports import render
from kvdoctor.formats.reports.github import github_annotations, in_github_actions
from kvdoctor.formats.reports.junit import render_junit
from kvdoctor.outputs import claim_output, printable, reader_may_leave, same_file, write_private
from kvdoctor.runner import analyze_recorded, default_trace_path
from kvdoctor.trace.schema import SCHEMA_NAME
from kvdoctor.units import parse_rate

if TYPE_CHECKING:
    from kvdoctor.analysis.analyzer import Analysis

TRACE_SNIFF_BYTES = 4096  # a trace's header line, where its schema name is, comes first


def _is_trace_path(args: list[str]) -> bool:
    """One existing file named *.json, or one that opens as a kvdoctor trace does (a trace saved
    as `.kvtrace`, or under a name with a typo, is judged, not run as a command), or one that is
    not a regular file at all (a FIFO, a device)."""
    if len(args) != 1 or not os.path.exists(args[0]) or os.path.isdir(args[0]):
        return False
    if not os.path.isfile(args[0]):
        return True  # a FIFO or a device is no command: refused as a trace, with a sentence, never opened
    if args[0].endswith(".json"):
        return True
    try:
        with open(args[0], "rb") as fh:
            start = fh.read(TRACE_SNIFF_BYTES)
    except OSError:
        return False
    return start.lstrip().startswith((b"[", b"{")) and SCHEMA_NAME.encode() in start


def budgets_from(max_growth: str, max_orphan_slots: int, fail_on: str, allow: str, engine: str) -> Budgets:
    if int(max_orphan_slots) < 0:
        raise KvdoctorError("--max-orphan-slots must be 0 or more")
    if engine not in ENGINE_CHOICES:
        raise KvdoctorError(f"--engine {engine!r} is not one kvdoctor probes", "choose " + ", ".join(ENGINE_CHOICES))
    growth_off = str(max_growth).strip().lower() in GROWTH_OFF
    return Budgets(
        max_growth_bytes_per_s=parse_rate(DEFAULT_MAX_GROWTH if growth_off else max_growth),
        judge_growth=not growth_off,
        max_orphan_slots=int(max_orphan_slots),
        fail_on=finding_kinds(fail_on, "--fail-on"),
        allow=finding_kinds(allow, "--allow") if allow else set(),
        engine=engine,
    )


def growth_params_for(budgets: Budgets) -> GrowthParams:
    """The growth test with the user's budget as its floor where that is below the default one: a
    budget the user sets is the budget (a steady 40 MiB/h fails a 10 MiB/h budget). Such a budget
    says slow growth matters here, so it drops the 64 MiB a climb must otherwise rise (a warm-up's
    worth of heap), which a rate that slow would take hours to reach."""
    budget = max(budgets.max_growth_bytes_per_s, 0.0)
    params = dataclasses.replace(GrowthParams(), budget_bytes_per_s=budgets.max_growth_bytes_per_s)
    if budget < DEFAULT_MIN_RATE_BYTES_PER_S:
        params = dataclasses.replace(params, min_rate_bytes_per_s=budget, min_rise_bytes=0.0)
    return params


def _baseline(path: str, budgets: Budgets) -> Analysis:
    """The baseline's analysis; a baseline that cannot be read is said as the baseline (the
    reader's own hint is about the trace being judged)."""
    try:
        return analyze_recorded(path, growth_params=growth_params_for(budgets))
    except TraceError as exc:
        raise KvdoctorError(
            f"--baseline {exc.message}",
            "give the trace of an earlier run, as `kvdoctor run --trace T` or `gate --trace T` writes it, or drop --baseline",
        ) from None


def _write(path: str, text: str, force: bool, what: str, inputs: list[str | None]) -> bool:
    try:
        write_private(path, text, force=force, what=what, inputs=inputs)
        return True
    except KvdoctorError as exc:
        print(exc.one_line(), file=sys.stderr)
        return False


def gate(
    command_or_trace: list[str],
    budgets: Budgets | None = None,
    *,
    junit: str | None = None,
    baseline: str | None = None,
    html: str | None = None,
    trace: str | None = None,
    force: bool = False,
    **budget_options: Any,
) -> int:
    """Judge a trace (one existing *.json path) or run a command under the probe and judge its trace.
    `budgets`, or the options `budgets_from` reads (max_growth, max_orphan_slots, fail_on, allow, engine)."""
    if budgets is None:
        options = {
            "max_growth": DEFAULT_MAX_GROWTH,
            "max_orphan_slots": 0,
            "fail_on": ",".join(DEFAULT_FAIL_ON),
            "allow": "",
            "engine": ANY_ENGINE,
            **budget_options,
        }
        budgets = budgets_from(**options)
    args = list(command_or_trace)
    if not args:
        raise KvdoctorError("nothing to judge", "usage: kvdoctor gate TRACE.json, or kvdoctor gate [OPTIONS] -- CMD ...")
    judging_a_trace = _is_trace_path(args)
    if not judging_a_trace and len(args) == 1 and os.path.isfile(args[0]) and not os.access(args[0], os.X_OK):
        if interpreter_of(args[0]) is None:  # no `#!`, no .py/.sh: more likely a trace that is not one
            raise KvdoctorError(
                f"{args[0]} is neither a kvdoctor trace nor an executable command",
                "give a trace that `kvdoctor run --trace T` wrote, or the command to run: kvdoctor gate -- CMD ...",
            )
    if judging_a_trace and trace is not None:
        raise KvdoctorError(
            "--trace says where a command's trace goes, but gate was given a trace to judge",
            "drop --trace, or run a command: kvdoctor gate --trace PATH -- CMD ...",
        )
    inputs = [args[0] if judging_a_trace else None, baseline]  # never written over, however spelled
    reports = [path for path in (junit, html) if path]
    outputs = reports + ([trace] if trace else [])
    for k, path in enumerate(outputs):
        if any(same_file(path, other) for other in outputs[k + 1 :]):
            raise KvdoctorError(f"{os.path.abspath(path)} is named for two of gate's outputs", "give each its own file")
    for path in reports:  # refused before a long run, not after it (the trace: by run_command)
        claim_output(path, force=force, inputs=inputs)
    baseline_analysis = _baseline(baseline, budgets) if baseline else None
    command_code = None
    if judging_a_trace:
        trace_path = args[0]
    else:
        command_code, trace_path = run_command(args, trace or default_trace_path("run"), [], force=force, inputs=inputs)
    analysis = analyze_recorded(trace_path, growth_params=growth_params_for(budgets))
    if command_code is None and analysis.command_exit is not None:
        command_code = analysis.command_exit  # a saved trace of `run`: judged exactly as the live run
    if baseline_analysis is not None:
        check_baseline_engines(analysis, baseline_analysis)
    result = judge(analysis, budgets, baseline_analysis, command_code=command_code)
    with reader_may_leave():  # a reader gone (`| head`) never turns the verdict into anything else
        if command_code is not None:
            ran = "the command in the trace" if judging_a_trace else "command"
            print(f"kvdoctor gate: {ran} exited {command_code}; trace {trace_path}")
        print(printable("\n".join(result.summary_lines())))
        for line in github_annotations(result) if in_github_actions() else []:
            print(line)
        sys.stdout.flush()
    written = all(
        [
            _write(junit, render_junit(result), force, "JUnit report", [trace_path, baseline]) if junit else True,
            _write(html, render(analysis, "html"), force, "HTML report", [trace_path, baseline]) if html else True,
        ]
    )
    code = result.exit_code
    return code if written or code != 0 else EXIT_UNUSABLE
