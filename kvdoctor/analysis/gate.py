"""Judging an analysis against budgets, for CI: every budget is one check that passes or fails.

"Could not judge" is its own outcome: an analysis with no events, or in which no process was ever
probed or sampled (only the run header of `kvdoctor run`, as a command that never started Python,
or never imported SGLang with the probe, leaves behind). Passing such a run would be a false
green, so it is neither pass nor fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdoctor.analysis.findings import Finding
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE
from kvdoctor.trace import schema
from kvdoctor.units import HOUR_S, MIB, as_float, as_int, format_rate

if TYPE_CHECKING:  # the CLI reads the defaults below without loading the detectors
    from kvdoctor.analysis.analyzer import Analysis

DEFAULT_MAX_GROWTH = "500MiB/h"
DEFAULT_FAIL_ON = (schema.DOUBLE_FREE, schema.DOUBLE_ALLOC, schema.STALE_LAST_LOC, schema.INDEX_OUT_OF_RANGE)
DEFAULT_TOLERANCE = 0.2  # a baseline regression is a rise of more than this fraction
RATE_DIGITS = 1  # growth rates in check details: "512.0 MiB/h"


def _rate_text(bytes_per_s: float) -> str:
    return format_rate(bytes_per_s, digits=RATE_DIGITS)


@dataclasses.dataclass
class Budgets:
    max_growth_bytes_per_s: float = 500 * MIB / HOUR_S
    max_orphan_slots: int = 0
    fail_on: set[str] = dataclasses.field(default_factory=lambda: set(DEFAULT_FAIL_ON))


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
    reason: str = ""  # why it could not judge, when judged is False
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

    def summary_lines(self) -> list[str]:
        lines = [f"kvdoctor gate: {self.source}"] if self.source else []
        for check in self.checks:
            lines.append(f"  {'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
        lines.append(self.verdict())
        return lines


def _growth_findings(analysis: Analysis) -> list[Finding]:
    return [f for f in analysis.findings if f.kind == schema.MEMORY_GROWTH]


def _rate_of(finding: Finding) -> float:
    return as_float(finding.evidence.get("bytes_per_s", 0.0) or 0.0) or 0.0


def _orphans(analysis: Analysis) -> int:
    return sum(as_int(f.count or 0) for f in analysis.findings if f.kind == schema.ORPHAN_SLOTS)


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


def _growth_check(analysis: Analysis, budgets: Budgets) -> Check:
    over = [f for f in _growth_findings(analysis) if _rate_of(f) > budgets.max_growth_bytes_per_s]
    budget_text = _rate_text(budgets.max_growth_bytes_per_s)
    if not over:
        seen = _max_growth(analysis)
        return Check("max-growth", True, f"no memory growth over {budget_text}" + (f" (fastest {_rate_text(seen)})" if seen else ""))
    parts = []
    for f in sorted(over, key=_rate_of, reverse=True):
        ev = f.evidence
        pid = ev.get("pid", f.pid)
        title = str(ev.get("process_title") or (analysis.processes.get(f.pid) or {}).get("process_title") or "")
        parts.append(
            f"pid {pid}{' (' + title[:60] + ')' if title else ''} {ev.get('memory_class', 'memory')} grows {_rate_text(_rate_of(f))}"
        )
    return Check("max-growth", False, f"over the budget of {budget_text}: " + "; ".join(parts))


def _kind_check(analysis: Analysis, kind: str) -> Check:
    hits = [f for f in analysis.findings if f.kind == kind]
    if not hits:
        return Check(f"no-{kind}", True, f"no {kind}")
    first = hits[0].message.splitlines()[0] if hits[0].message else ""
    return Check(f"no-{kind}", False, f"{sum(max(f.count, 1) for f in hits)} {kind} event(s): {first[:300]}")


def _baseline_check(analysis: Analysis, baseline: Analysis, tolerance: float) -> Check:
    pairs: list[tuple[str, float, float, Callable[[float], str]]] = [
        ("error findings", len(analysis.errors), len(baseline.errors), lambda n: str(int(n))),
        ("orphaned slots", _orphans(analysis), _orphans(baseline), lambda n: str(int(n))),
        ("max growth rate", _max_growth(analysis), _max_growth(baseline), _rate_text),
    ]
    worse = [
        f"{name} {fmt(now)} vs baseline {fmt(before)}"
        for name, now, before, fmt in pairs
        if now > before * (1.0 + tolerance) and now > before
    ]
    if worse:
        return Check("baseline-regression", False, f"worse than the baseline by more than {tolerance:.0%}: " + "; ".join(worse))
    return Check("baseline-regression", True, f"no regression over the baseline (tolerance {tolerance:.0%})")


def judge(analysis: Analysis, budgets: Budgets, baseline: Analysis | None = None, tolerance: float = DEFAULT_TOLERANCE) -> GateResult:
    result = GateResult(source=analysis.source)
    ok, reason = judgeable(analysis)
    if not ok:
        result.judged, result.reason = False, reason
        return result
    result.checks.append(_growth_check(analysis, budgets))
    orphans = _orphans(analysis)
    result.checks.append(
        Check(
            "max-orphan-slots",
            orphans <= budgets.max_orphan_slots,
            f"{orphans} orphaned KV slot(s) at the census, budget {budgets.max_orphan_slots}",
        )
    )
    result.checks.extend(_kind_check(analysis, kind) for kind in sorted(budgets.fail_on))
    if baseline is not None:
        result.checks.append(_baseline_check(analysis, baseline, tolerance))
    return result
