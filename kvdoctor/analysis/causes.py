"""Findings in the order a person reasons: severity first, then what happened first and what caused
what, and each consequence naming its cause ("caused by double_free x64 at _finish").

A finding made from the probe's rule events knows when its first event came (`Finding.first_ts_us`);
one made at a census (orphans, disagreeing counts) comes after them. A later error finding of the
same process whose slots overlap an earlier one's is its consequence: a double free puts slots on the
free list twice, so the next allocations hand them out twice; a stale `last_loc` frees or reuses
slots a request still owns."""

from __future__ import annotations

from kvdoctor.analysis.findings import ERROR, INFO, WARNING, Finding
from kvdoctor.trace import schema

SEVERITY_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}
# Where two findings cannot be told apart by time, the kind that causes comes first.
CAUSE_RANK = {schema.STALE_LAST_LOC: 0, schema.INDEX_OUT_OF_RANGE: 1, schema.DOUBLE_FREE: 2, schema.DOUBLE_ALLOC: 4, schema.ORPHAN_SLOTS: 5}
SLOTS_COMPARED = 64  # the slot ids a finding keeps in its evidence


def _slots(finding: Finding) -> set[object]:
    ids = finding.evidence.get("slot_ids")
    slots = {i for i in ids[:SLOTS_COMPARED] if isinstance(i, (int, str))} if isinstance(ids, list) else set()
    bad = finding.evidence.get("bad_index")  # an index outside the buffer is the "slot" it passes on
    return slots | ({bad} if isinstance(bad, (int, str)) and not isinstance(bad, bool) else set())


def _where(finding: Finding) -> str:
    site = str(finding.evidence.get("site") or "").split(" < ")[0]
    return site.split(" (")[0].strip()


def ordered(findings: list[Finding]) -> list[Finding]:
    """Severity, then the time of the first event (findings of a census after those of events),
    then the kind that causes before the kind it causes, then the larger count; each error
    consequence gets `caused_by` and its message a "caused by ..." clause."""
    out = sorted(
        findings,
        key=lambda f: (
            SEVERITY_ORDER.get(f.severity, 9),
            f.first_ts_us is None,
            f.first_ts_us or 0.0,
            CAUSE_RANK.get(f.kind, 3),
            f.kind,
            -f.count,
        ),
    )
    errors = [f for f in out if f.severity == ERROR]
    for k, finding in enumerate(errors):
        if finding.caused_by:
            continue
        mine = _slots(finding)
        if not mine:
            continue
        cause = next(
            (
                c
                for c in errors[:k]
                if c.pid == finding.pid
                and _slots(c) & mine
                and (c.kind, c.evidence.get("site")) != (finding.kind, finding.evidence.get("site"))
            ),
            None,
        )
        if cause is None:
            continue
        at = f" at {_where(cause)}" if _where(cause) else ""
        finding.caused_by = f"{cause.kind} x{cause.counted()}{at}"
        finding.message = f"{finding.message.rstrip('.')}; caused by {finding.caused_by}"
    return out
