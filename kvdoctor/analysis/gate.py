"""Judging an analysis against budgets (kvdoctor.analysis.budgets), for CI: every budget is one
check that passes or fails.

A gate that passes a crashed benchmark is worse than none, so it fails when the command failed,
when no probe reported from the engine it was meant to watch, and on any error finding the user
did not waive by name. "Could not judge" is its own outcome: an analysis with no events, or a
check with nothing to judge (no census ran, so no slot was ever counted: no orphan verdict exists)
while nothing else failed. A record that stops early cannot vouch for the end of the run: a probe
that turned itself off, dropped events or stopped writing, a ledger that held slots and was never
counted, probe events from a process whose header is missing or damaged, or unreadable lines in
the trace make the gate "could not judge", with the reason (kvdoctor.analysis.record). A process
that outlived the command (it left the command's process group, so `run` did not end it) is a
warning line, never a failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdoctor.analysis.admission import MAX_PROCESSES
from kvdoctor.analysis.budgets import ANY_ENGINE, BUDGETED_KINDS, Budgets
from kvdoctor.analysis.findings import Finding
from kvdoctor.analysis.gate_growth import growth_by_process
from kvdoctor.analysis.gate_orphans import census_basis, named_orphans
from kvdoctor.analysis.gate_result import Check, GateResult
from kvdoctor.errors import KvdoctorError
from kvdoctor.trace import schema
from kvdoctor.units import as_float, as_int, format_rate, short_title

if TYPE_CHECKING:  # `run` reads outlived_sentence without loading the detectors
    from kvdoctor.analysis.analyzer import Analysis

DEFAULT_TOLERANCE = 0.2  # a baseline regression is a rise of more than this fraction
GROWTH_HINT = "judge growth on a longer run, or pass --max-growth off to judge the rest alone"
RATE_DIGITS = 1  # growth rates in check details: "512.0 MiB/h"


def _rate_text(bytes_per_s: float) -> str:
    return format_rate(bytes_per_s, digits=RATE_DIGITS)


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
    return True, ""


def _probed(analysis: Analysis) -> dict[str, list[int]]:
    """engine -> the pids whose probe reported from it (not those the sampler only guessed from a title)."""
    out: dict[str, list[int]] = {}
    for pid, info in sorted(analysis.processes.items()):
        engine = str((info or {}).get("engine") or "")
        if engine and (info or {}).get("probe"):
            out.setdefault(engine, []).append(pid)
    return out


def _probe_check(analysis: Analysis, engine: str, required: bool) -> Check:
    probed = _probed(analysis)
    seen = "; ".join(f"{e}: pid{'s' if len(p) > 1 else ''} {', '.join(map(str, p[:8]))}" for e, p in probed.items())
    if any(engine in (ANY_ENGINE, e) for e in probed):
        return Check("probe-reported", True, f"judged the processes the probe reported from ({seen})")
    if not required and not probed:
        return Check("probe-reported", True, "no probe in this trace: memory is judged, KV slots are not")
    others = [f"pid {pid} {str((info or {}).get('process_title') or '')[:50]}".strip() for pid, info in sorted(analysis.processes.items())]
    expected = "an engine" if engine == ANY_ENGINE else engine
    detail = f"no probe reported from {expected}" + (f" (the probe reported from {seen})" if seen else "")
    if analysis.probe_path_lost:  # `run` saw why: the command's own environment dropped the probe's way in
        return Check("probe-reported", False, detail + ": " + "; ".join(map(_path_lost_sentence, analysis.probe_path_lost[:4])))
    detail += "; processes in the trace: " + ("; ".join(others[:6]) or "none") + ": did the server start, and under kvdoctor?"
    return Check("probe-reported", False, detail)


def _path_lost_sentence(process: dict[str, Any]) -> str:
    where = f"pid {process['pid']} ({short_title(str(process.get('title') or '?'), 60)})"
    if process.get("lost") == "environment":
        return f"{where}: the process's environment lost kvdoctor's variables (KVDOCTOR_TRACE): pass the environment on to it"
    return (
        f"{where}: the process's PYTHONPATH lost kvdoctor's directory: keep $PYTHONPATH in it "
        "(PYTHONPATH=DIR:$PYTHONPATH), or install kvdoctor into that Python's environment"
    )


def _listed(items: dict[Any, str], most: int = 4) -> str:
    text = "; ".join(f"{key}: {why}" for key, why in list(items.items())[:most])
    return text + (f"; and {len(items) - most} more" if len(items) > most else "")


def _completeness_check(analysis: Analysis) -> Check:
    """Whether every probe's record reaches the end of the run, so a clean verdict can stand on it."""
    gaps: dict[str, str] = {f"pid {pid}": why for pid, why in analysis.stopped_early.items()}
    for pid in analysis.unheaded_pids[:8]:
        gaps[f"pid {pid}"] = "it wrote probe events but its probe header is missing or damaged, so no engine can be named for it"
    if analysis.damaged_lines:
        gaps["the trace"] = f"{analysis.damaged_lines} line(s) could not be read"
    if analysis.end_events != 1:
        gaps["the run"] = (
            "the trace has no end event (the run was killed or is still running), so what happened at its end is not in it"
            if analysis.end_events == 0
            else f"the trace has {analysis.end_events} end events, so which exit code ends the run cannot be told"
        )
    if gaps:
        detail = "the record stops early or cannot be read, so a clean verdict cannot vouch for the whole run: " + _listed(gaps)
        return Check("probe-complete", False, detail, judged=False)
    probed = sum(len(pids) for pids in _probed(analysis).values())
    if not probed:
        return Check("probe-complete", True, "no probe in this trace")
    return Check("probe-complete", True, f"every probe's record reaches the end ({probed} process{'es' if probed > 1 else ''})")


def _orphan_check(analysis: Analysis, budgets: Budgets) -> Check:
    if analysis.uncounted_ledgers:
        detail = "a ledger that held slots was never counted by a census, so no orphan verdict covers it: " + _listed(
            analysis.uncounted_ledgers
        )
        return Check("max-orphan-slots", False, detail, judged=False)
    if not _probed(analysis):
        if analysis.unheaded_pids:
            detail = "probe events without a readable probe header (pid " + ", ".join(map(str, analysis.unheaded_pids[:8])) + ")"
            return Check("max-orphan-slots", False, detail + ": no verdict stands on them", judged=False)
        return Check(
            "max-orphan-slots", False, "not applicable: no probed process, so no slot ledger to judge", judged=False, applicable=False
        )
    if analysis.damaged_censuses:
        what = "; ".join(f"{ledger}: {reason}" for ledger, reason in list(analysis.damaged_censuses.items())[:4])
        return Check("max-orphan-slots", False, f"a census in the trace is damaged, so no verdict stands on it ({what})", judged=False)
    if not analysis.censuses:
        if analysis.not_judged:
            why = "; ".join(f"{ledger}: {reason}" for ledger, reason in list(analysis.not_judged.items())[:4])
            detail = f"no census the probe could judge: it cannot prove it sees every holder of these pools ({why})"
            return Check("max-orphan-slots", False, detail, judged=False)
        detail = (
            "no census ran: no slot was counted (the engine was never idle and was killed before its exit census); "
            "run the server under `kvdoctor run`/`gate` and stop it with SIGINT or SIGTERM to its launcher, "
            "or leave it idle for a second before stopping it"
        )
        return Check("max-orphan-slots", False, detail, judged=False)
    orphans = _orphans(analysis)
    basis = census_basis(analysis)
    if analysis.not_judged:
        basis += "; not judged: " + "; ".join(f"{ledger} ({reason})" for ledger, reason in list(analysis.not_judged.items())[:4])
    passed = orphans <= budgets.max_orphan_slots
    named = "" if passed else named_orphans(analysis)
    return Check(
        "max-orphan-slots",
        passed,
        f"{orphans} orphaned KV slot(s) at the census, budget {budgets.max_orphan_slots}"
        + (f": {named}" if named else "")
        + (f"; judged on {basis}" if basis else ""),
    )


def _unanalysed_check(analysis: Analysis) -> Check:
    """Processes whose slots the probe counted but the analysis had no room for: what they hold is
    unknown, so nothing can pass on their account (a leak in them fails the gate once analysed)."""
    return Check(
        "every-process-analysed",
        False,
        f"{analysis.unanalysed_verdict_events} census and rule event(s) of processes beyond the {MAX_PROCESSES} one analysis "
        "holds were not analysed: split the run, or judge fewer processes per trace",
        judged=False,
    )


def _other_errors_check(analysis: Analysis, budgets: Budgets) -> Check:
    """Every error finding fails the gate unless its kind was waived (`--allow`)."""
    counted = set(budgets.fail_on) | set(BUDGETED_KINDS)
    hits: dict[str, int] = {}
    for f in analysis.errors:
        if f.kind not in counted and f.kind not in budgets.allow:
            hits[f.kind] = hits.get(f.kind, 0) + max(f.count, 1)
    waived = sorted(budgets.allow)
    if not hits:
        return Check("no-other-errors", True, "no other error finding" + (f" (waived: {', '.join(waived)})" if waived else ""))
    listed = ", ".join(f"{kind} x{count}" for kind, count in sorted(hits.items()))
    return Check("no-other-errors", False, f"error findings: {listed} (waive a kind by name with --allow if it is expected)")


def _growth_check(analysis: Analysis, budgets: Budgets) -> Check:
    """Broken when a growth finding's rate is over the budget; held only when every process
    sampled to the end has each memory class bounded under it (kvdoctor.analysis.growth_verdict);
    otherwise not judged, with the reason, like a missing census."""
    if not budgets.judge_growth:
        return Check("max-growth", False, "turned off (--max-growth off): memory growth was not judged", judged=False, off=True)
    over = [f for f in _growth_findings(analysis) if _rate_of(f) > budgets.max_growth_bytes_per_s]
    budget_text = _rate_text(budgets.max_growth_bytes_per_s)
    if over:
        parts = []
        for f in sorted(over, key=_rate_of, reverse=True):
            ev = f.evidence
            pid = ev.get("pid", f.pid)
            title = str(ev.get("process_title") or (analysis.processes.get(f.pid) or {}).get("process_title") or "")
            parts.append(
                f"pid {pid}{' (' + title[:60] + ')' if title else ''} {ev.get('memory_class', 'memory')} grows {_rate_text(_rate_of(f))}"
            )
        return Check("max-growth", False, f"over the budget of {budget_text}: " + "; ".join(parts))
    held, unjudged, gone = growth_by_process(analysis, budgets.max_growth_bytes_per_s)
    if not held and not unjudged:
        return Check("max-growth", False, "not judged: no memory sample in the trace", judged=False)
    if unjudged:
        detail = f"not judged against {budget_text}: " + _listed(unjudged, 3) + (f"; held: {_listed(held, 2)}" if held else "")
        return Check("max-growth", False, detail + f" ({GROWTH_HINT})", judged=False)
    seen = _max_growth(analysis)
    detail = f"held under {budget_text}" + (f" (fastest {_rate_text(seen)})" if seen else "") + ": " + _listed(held, 3)
    if gone:
        detail += f"; not judged, exited during the run: {_listed(gone, 2)}"
    return Check("max-growth", True, detail)


def outlived_sentence(outlived: list[dict[str, Any]]) -> str:
    named = ", ".join(f"pid {p['pid']} ({str(p.get('title') or '?')[:60]})" for p in outlived[:8])
    return (
        f"{len(outlived)} process(es) started by the command outlived it: {named}; they left its process group "
        "(setsid or setpgid), so nothing ended them (kill them if they are not meant to run on)"
    )


def _outlived_check(analysis: Analysis) -> Check:
    """A warning, never a failure: what a leftover does after the run is outside the run's verdict
    (its memory and slots up to the end were judged like the rest), and a daemon may be meant to
    run on; but it can hold GPU memory or a port into the next job, so the gate says so."""
    if not analysis.outlived:
        return Check("no-leftover-processes", True, "no process the sampler saw outlived the command")
    return Check("no-leftover-processes", True, outlived_sentence(analysis.outlived), warning=True)


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


def judge(
    analysis: Analysis,
    budgets: Budgets,
    baseline: Analysis | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    command_code: int | None = None,
) -> GateResult:
    """The checks, in order: the command's exit code (when one ran), that a probe reported, that
    every probe's record reaches the end, memory growth, orphaned slots, each `fail_on` kind,
    every other error finding, the baseline, and (when a command ran) what outlived it, a warning."""
    result = GateResult(source=analysis.source)
    if command_code is not None:
        result.checks.append(
            Check(
                "command-exit",
                command_code == 0,
                f"the command exited {command_code}" + ("" if command_code == 0 else ": a failed run is not a pass"),
            )
        )
    ok, reason = judgeable(analysis)
    if not ok:
        result.judged, result.reason = False, reason
        return result
    result.checks.append(_probe_check(analysis, budgets.engine, required=command_code is not None or budgets.engine != ANY_ENGINE))
    result.checks.append(_completeness_check(analysis))
    result.checks.append(_growth_check(analysis, budgets))
    result.checks.append(_orphan_check(analysis, budgets))
    if analysis.unanalysed_verdict_events:
        result.checks.append(_unanalysed_check(analysis))
    result.checks.extend(_kind_check(analysis, kind) for kind in sorted(budgets.fail_on - budgets.allow - set(BUDGETED_KINDS)))
    result.checks.append(_other_errors_check(analysis, budgets))
    if baseline is not None:
        result.checks.append(_baseline_check(analysis, baseline, tolerance))
    if command_code is not None:
        result.checks.append(_outlived_check(analysis))
    return result


def check_baseline_engines(analysis: Analysis, baseline: Analysis) -> None:
    """A baseline from another engine says nothing about this run: refused with a sentence."""
    mine, theirs = set(_probed(analysis)), set(_probed(baseline))
    if mine and theirs and not mine & theirs:
        raise KvdoctorError(
            f"the baseline {baseline.source} was probed from {', '.join(sorted(theirs))}, this run from {', '.join(sorted(mine))}",
            "compare runs of the same engine",
        )
