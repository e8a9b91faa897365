"""Plain terminal text: one block per finding, errors first, evidence a reader can act on.

Everything that came from the trace (titles, request ids, call sites, the sentences built from
them) passes through `one_line`: a client's request id must not clear the terminal, set its
title, reverse a line or start a report line of its own."""

from __future__ import annotations

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.analysis.findings import ERROR, INFO, WARNING
from kvdoctor.analysis.gate_growth import growth_not_judged
from kvdoctor.analysis.slot_history import report_lines
from kvdoctor.formats.reports.bounded import PROCESSES_SHOWN, first_processes, shown_findings
from kvdoctor.outputs import one_line, printable
from kvdoctor.trace.schema import STATUS_KINDS
from kvdoctor.units import short_title

MARK = {ERROR: "ERROR", WARNING: "warn ", INFO: "info "}
EVIDENCE_KEYS = (
    "slot_ids",
    "site",
    "allocated_at",
    "requests",
    "released_on",
    "bad_index",
    "bytes_per_hour",
    "memory_class",
    "time_to_oom_s",
)


def render_text(analysis: Analysis) -> str:
    lines = []
    listed, unlisted = first_processes(analysis.processes, PROCESSES_SHOWN)
    procs = ", ".join(
        f"{pid} {short_title(one_line(info.get('process_title', '')), 48)}".strip()
        + (f" [{one_line(info.get('engine'))} {one_line(info.get('engine_version'))}]" if info.get("engine") else "")
        for pid, info in listed
    ) + (f" and {unlisted} more" if unlisted else "")
    lines.append(f"kvdoctor: {analysis.events} events from {analysis.source or 'the run'}" + (f"; processes: {procs}" if procs else ""))
    for note in analysis.notes:
        lines.append(f"  note: {one_line(note)}")
    if not analysis.findings:
        probed = any(info.get("engine") and info.get("probe") for info in analysis.processes.values())
        if analysis.unanalysed_verdict_events:
            lines.append("no findings in the processes analysed; some whose slots the probe counted were not (see the note)")
        elif analysis.censuses:
            lines.append("no findings: every slot is accounted for")
        elif probed:
            lines.append(
                "no findings, but no census ran: no slot was counted (the engine was never idle and was killed before its exit census)"
            )
        elif engines := sorted({str(info["engine"]) for info in analysis.processes.values() if info.get("engine")}):
            # the sampler named an engine's process, and no probe reported from it: a clean verdict would be false
            lines.append(
                f"no findings, but no probe reported from the {', '.join(map(one_line, engines))} process(es): nothing was checked"
            )
        else:
            lines.append("no findings")
    shown, left = shown_findings(analysis.findings)
    for finding in shown:
        mark = MARK.get(finding.severity, one_line(finding.severity))
        counted = "" if finding.kind in STATUS_KINDS or not finding.count else f" x{finding.counted()}"  # "x0" would read as "none"
        lines.append(f"{mark} {one_line(finding.kind)}{counted}: {one_line(finding.message)}")
        for key in EVIDENCE_KEYS:
            value = finding.evidence.get(key)
            if value in (None, "", [], {}):
                continue
            if isinstance(value, dict):
                value = "; ".join(f"{k}: {v}" for k, v in list(value.items())[:4])
            elif isinstance(value, list):
                value = ", ".join(str(v) for v in value[:16]) + (" ..." if len(value) > 16 else "")
            lines.append(f"        {key}: {one_line(value)}")
        lines += [one_line(line) for line in report_lines(finding.evidence, "        ")]  # the flight recorder's timeline
    lines += [rest.sentence() for rest in left]
    unjudged = growth_not_judged(analysis)
    if unjudged:
        lines.append(one_line(unjudged))
    errors = len(analysis.errors)
    lines.append(f"{errors} error finding(s), {len(analysis.findings) - errors} other")
    return printable("\n".join(lines))
