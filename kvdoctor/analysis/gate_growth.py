"""The growth budget's verdict per process, for the gate (kvdoctor.analysis.gate) and watch's
last line: each process's least certain memory class, held, not judged, or not judged but gone
before the run's end (what a process that exited held went with it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdoctor.analysis.growth_verdict import BROKEN, HELD, NOT_JUDGED, growth_verdict
from kvdoctor.trace import schema
from kvdoctor.units import as_float, as_int

if TYPE_CHECKING:
    from kvdoctor.analysis.analyzer import Analysis


def _rate_of(evidence: dict[str, Any]) -> float:
    return as_float(evidence.get("bytes_per_s", 0.0) or 0.0) or 0.0


def growth_by_process(
    analysis: Analysis, budget_bytes_per_s: float, *, broken_apart: bool = False
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """("pid N (title)" -> why) for the processes whose growth is held, not judged, and not judged
    but gone before the end (exited during the run), each with its least certain memory class.
    `broken_apart`: a process whose growth broke the budget (its finding says so) is in none."""
    found = {
        (as_int(f.evidence.get("pid", f.pid)), str(f.evidence.get("memory_class"))): _rate_of(f.evidence)
        for f in analysis.findings
        if f.kind == schema.MEMORY_GROWTH
    }
    worst: dict[int, tuple[int, str, dict[str, Any]]] = {}
    rank = {HELD: 0, NOT_JUDGED: 1, BROKEN: 2}
    for evidence in analysis.growth_evidence:
        pid, memory_class = as_int(evidence.get("pid")), str(evidence.get("memory_class"))
        status, why = growth_verdict(evidence, found.get((pid, memory_class)), budget_bytes_per_s)
        text = f"{memory_class} {why}"
        if pid not in worst or rank[status] > worst[pid][0]:
            worst[pid] = (rank[status], text, evidence)
    held: dict[str, str] = {}
    unjudged: dict[str, str] = {}
    gone: dict[str, str] = {}
    for pid, (level, text, evidence) in sorted(worst.items()):
        title = str(evidence.get("process_title") or (analysis.processes.get(pid) or {}).get("process_title") or "")
        name = f"pid {pid}" + (f" ({title[:40]})" if title else "")
        if level == 2 and broken_apart:
            continue
        if level == 0:
            held[name] = text
        elif evidence.get("exited_early"):
            gone[name] = text
        else:
            unjudged[name] = text
    return held, unjudged, gone


def not_judged_sentence(named: dict[str, str], shown: int = 4) -> str:
    """One line for the processes whose growth was not judged ("pid N (title)" -> why), as watch's
    last line and the reports say it; "" for none."""
    if not named:
        return ""
    listed = "; ".join(f"{name}: {why}" for name, why in list(named.items())[:shown])
    more = f"; and {len(named) - shown} more" if len(named) > shown else ""
    return f"memory growth not judged ({listed}{more})"


def growth_not_judged(analysis: Analysis) -> str:
    """`not_judged_sentence` of an analysis, against the floor its growth test used; "" where
    every process was judged or none had memory sampled."""
    budget = analysis.growth_budget_bytes_per_s
    if budget is None or not analysis.growth_evidence:
        return ""
    _held, unjudged, gone = growth_by_process(analysis, budget, broken_apart=True)
    return not_judged_sentence({**unjudged, **gone})
