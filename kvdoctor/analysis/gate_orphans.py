"""What the gate's orphan verdict names (kvdoctor.analysis.gate): the census it stands on, and the
largest orphan findings by their evidence."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdoctor.trace import schema
from kvdoctor.units import as_int

if TYPE_CHECKING:
    from kvdoctor.analysis.analyzer import Analysis


def census_basis(analysis: Analysis) -> str:
    """Which census the orphan verdict stands on, per probed process, and how old it was when the
    run ended: a rolling one misses a leak made after it."""
    parts = []
    for pid, last in sorted(analysis.last_censuses.items())[:8]:
        reason = last.get("reason") or "a"
        age_s = last.get("age_s")
        if age_s is None and analysis.end_ts_us and last.get("ts_us"):
            age_s = max(0.0, (analysis.end_ts_us - float(last["ts_us"])) / 1e6)
        text = f"pid {pid}: the {reason} census"
        if age_s is not None:
            text += f", {float(age_s):.1f} s before the end"
        if reason == "rolling":
            text += " (a leak made after it is not seen)"
        parts.append(text)
    return "; ".join(parts)


def named_orphans(analysis: Analysis, most: int = 3) -> str:
    """The largest orphan findings by their evidence: slots, where they were allocated, for whom."""
    parts = []
    for finding in sorted((f for f in analysis.findings if f.kind == schema.ORPHAN_SLOTS), key=lambda f: -as_int(f.count or 0))[:most]:
        ev = finding.evidence
        slots = [str(s) for s in (ev.get("slot_ids") or [])[:8]]
        text = f"{finding.count} in pid {ev.get('pid', finding.pid)} {ev.get('allocator', '')}".rstrip()
        if slots:
            text += f" (slots {', '.join(slots)}{', ...' if as_int(finding.count or 0) > len(slots) else ''})"
        site = next(iter(ev.get("allocated_at") or {}), "")
        request = next(iter(ev.get("requests") or {}), "")
        if site:
            text += f", allocated by {str(site).split(' < ')[0]}"
        if request:
            text += f" for {request}"
        parts.append(text)
    return "; ".join(parts)
