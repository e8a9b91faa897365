"""Plain terminal text: one block per finding, errors first, evidence a reader can act on.

Everything that came from the trace (titles, request ids) passes through `printable`: a client's
request id must not clear the terminal or set its title."""

from __future__ import annotations

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.analysis.findings import ERROR, INFO, WARNING
from kvdoctor.outputs import printable

MARK = {ERROR: "ERROR", WARNING: "warn ", INFO: "info "}
EVIDENCE_KEYS = ("slot_ids", "site", "allocated_at", "requests", "bad_index", "bytes_per_hour", "memory_class", "time_to_oom_s")


def render_text(analysis: Analysis) -> str:
    lines = []
    procs = ", ".join(
        f"{pid} {str(info.get('process_title', ''))[:40]}".strip()
        + (f" [{info.get('engine')} {info.get('engine_version')}]" if info.get("engine") else "")
        for pid, info in sorted(analysis.processes.items())
    )
    lines.append(f"kvdoctor: {analysis.events} events from {analysis.source or 'the run'}" + (f"; processes: {procs}" if procs else ""))
    for note in analysis.notes:
        lines.append(f"  note: {note}")
    if not analysis.findings:
        probed = any(info.get("engine") and info.get("probe") for info in analysis.processes.values())
        if analysis.censuses:
            lines.append("no findings: every slot is accounted for")
        elif probed:
            lines.append(
                "no findings, but no census ran: no slot was counted (the engine was never idle and was killed before its exit census)"
            )
        else:
            lines.append("no findings")
    for finding in analysis.findings:
        lines.append(f"{MARK.get(finding.severity, finding.severity)} {finding.kind} x{finding.count}: {finding.message}")
        for key in EVIDENCE_KEYS:
            value = finding.evidence.get(key)
            if value in (None, "", [], {}):
                continue
            if isinstance(value, dict):
                value = "; ".join(f"{k}: {v}" for k, v in list(value.items())[:4])
            elif isinstance(value, list):
                value = ", ".join(str(v) for v in value[:16]) + (" ..." if len(value) > 16 else "")
            lines.append(f"        {key}: {value}")
    errors = len(analysis.errors)
    lines.append(f"{errors} error finding(s), {len(analysis.findings) - errors} other")
    return printable("\n".join(lines))
