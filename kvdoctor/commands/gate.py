"""`kvdoctor gate`: judge a trace (or a command run under the probe) against budgets, for CI.

Exit codes: 0 every check passed, 1 a check failed, 2 could not judge. "Could not judge" means
the analysis has no events, or no process in it was ever probed or sampled: only the run header
of `kvdoctor run` is there (no probe header with an engine, no memory/KV counters, no findings),
which is what a command that never started Python, or never imported SGLang with the probe, leaves
behind. Passing such a run would be a false green, so it is neither pass nor fail.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any
from xml.sax.saxutils import escape as _xml_escape, quoteattr as _xml_attr

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE, KvdoctorError
from kvdoctor.units import format_rate, parse_rate, parse_size  # noqa: F401 (parse_size: the gate's size unit)

MIB = 1024 * 1024
DEFAULT_MAX_GROWTH = "500MiB/h"
DEFAULT_FAIL_ON = "double_free,double_alloc,stale_last_loc,index_out_of_range"

@dataclasses.dataclass
class Budgets:
    max_growth_bytes_per_s: float = 500 * MIB / 3600.0
    max_orphan_slots: int = 0
    fail_on: set[str] = dataclasses.field(
        default_factory=lambda: {"double_free", "double_alloc", "stale_last_loc", "index_out_of_range"}
    )


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


@dataclasses.dataclass
class GateResult:
    checks: list[Check] = dataclasses.field(default_factory=list)
    judged: bool = True
    reason: str = ""          # why it could not judge, when judged is False
    source: str = ""

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def exit_code(self) -> int:
        if not self.judged:
            return EXIT_UNUSABLE
        return EXIT_FINDINGS if self.failed else EXIT_OK

    def verdict(self) -> str:
        if not self.judged:
            return f"kvdoctor gate: COULD NOT JUDGE ({self.reason})"
        if self.failed:
            return f"kvdoctor gate: FAIL ({len(self.failed)} of {len(self.checks)} checks failed)"
        return f"kvdoctor gate: PASS ({len(self.checks)} checks)"


def _rate_text(bytes_per_s: float) -> str:
    return format_rate(bytes_per_s, digits=1)


def _growth_findings(analysis: Analysis) -> list:
    return [f for f in analysis.findings if f.kind == "memory_growth"]


def _rate_of(finding) -> float:
    try:
        return float(finding.evidence.get("bytes_per_s", 0.0) or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _orphans(analysis: Analysis) -> int:
    return sum(int(f.count or 0) for f in analysis.findings if f.kind == "orphan_slots")


def _max_growth(analysis: Analysis) -> float:
    return max((_rate_of(f) for f in _growth_findings(analysis)), default=0.0)


def judgeable(analysis: Analysis) -> tuple[bool, str]:
    if analysis.events <= 0:
        return False, "the trace has no events"
    if not analysis.processes:
        return False, "no process header in the trace"
    probed = any((info or {}).get("engine") for info in analysis.processes.values())
    if not (probed or analysis.series or analysis.findings):
        return False, "no probed or sampled process wrote to the trace (did the command start Python with SGLang?)"
    return True, ""


def judge(analysis: Analysis, budgets: Budgets, baseline: Analysis | None = None, tolerance: float = 0.2) -> GateResult:
    result = GateResult(source=analysis.source)
    ok, reason = judgeable(analysis)
    if not ok:
        result.judged, result.reason = False, reason
        return result

    over = [f for f in _growth_findings(analysis) if _rate_of(f) > budgets.max_growth_bytes_per_s]
    budget_text = _rate_text(budgets.max_growth_bytes_per_s)
    if over:
        parts = []
        for f in sorted(over, key=_rate_of, reverse=True):
            ev = f.evidence
            pid = ev.get("pid", f.pid)
            title = str(ev.get("process_title") or (analysis.processes.get(f.pid) or {}).get("process_title") or "")
            parts.append(f"pid {pid}{' (' + title[:60] + ')' if title else ''} {ev.get('memory_class', 'memory')} grows {_rate_text(_rate_of(f))}")
        result.checks.append(Check("max-growth", False, f"over the budget of {budget_text}: " + "; ".join(parts)))
    else:
        seen = _max_growth(analysis)
        detail = f"no memory growth over {budget_text}" + (f" (fastest {_rate_text(seen)})" if seen else "")
        result.checks.append(Check("max-growth", True, detail))

    orphans = _orphans(analysis)
    result.checks.append(Check(
        "max-orphan-slots", orphans <= budgets.max_orphan_slots,
        f"{orphans} orphaned KV slot(s) at the census, budget {budgets.max_orphan_slots}",
    ))

    for kind in sorted(budgets.fail_on):
        hits = [f for f in analysis.findings if f.kind == kind]
        if hits:
            first = hits[0].message.splitlines()[0] if hits[0].message else ""
            detail = f"{sum(max(f.count, 1) for f in hits)} {kind} event(s): {first[:300]}"
        else:
            detail = f"no {kind}"
        result.checks.append(Check(f"no-{kind}", not hits, detail))

    if baseline is not None:
        worse = []
        pairs = [
            ("error findings", len(analysis.errors), len(baseline.errors), str),
            ("orphaned slots", orphans, _orphans(baseline), str),
            ("max growth rate", _max_growth(analysis), _max_growth(baseline), _rate_text),
        ]
        for name, now, before, fmt in pairs:
            if now > before * (1.0 + tolerance) and now > before:
                worse.append(f"{name} {fmt(now)} vs baseline {fmt(before)}")
        detail = ("worse than the baseline by more than " + f"{tolerance:.0%}: " + "; ".join(worse)) if worse else \
            f"no regression over the baseline (tolerance {tolerance:.0%})"
        result.checks.append(Check("baseline-regression", not worse, detail))
    return result


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


def summary_lines(result: GateResult) -> list[str]:
    lines = [f"kvdoctor gate: {result.source}"] if result.source else []
    for check in result.checks:
        lines.append(f"  {'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
    lines.append(result.verdict())
    return lines


def _is_trace_path(args: list[str]) -> bool:
    return len(args) == 1 and args[0].endswith(".json") and os.path.isfile(args[0])


def gate(
    command_or_trace: list[str],
    *,
    max_growth: str = DEFAULT_MAX_GROWTH,
    max_orphan_slots: int = 0,
    fail_on: str = DEFAULT_FAIL_ON,
    junit: str | None = None,
    baseline: str | None = None,
    html: str | None = None,
    trace: str | None = None,
    tolerance: float = 0.2,
) -> int:
    """Judge a trace (one existing *.json path) or run a command under the probe and judge its trace."""
    from kvdoctor.commands.replay import analyze_trace

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
    print("\n".join(summary_lines(result)))
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
