"""Slot histories as a trace holds them (schema.SLOT_HISTORY): read back with every field checked,
put on a short timeline, and found by slot for `kvdoctor replay --slot`.

A trace comes from outside: a history that is not a list of pages, each with a list of entries,
is dropped; a field of the wrong type reads as unknown. Nothing here raises on a crafted trace.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvdoctor.trace import schema

MAX_PAGES = 8
MAX_ENTRIES = 64
SHOWN_IN_REPORT = 1  # pages whose timeline a terminal report prints under a finding


def _int(value: Any) -> int | None:
    return value if type(value) is int else None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def clean_pages(value: Any) -> list[dict[str, Any]]:
    """The pages of a history as a trace gave them, each {page, first_slot, page_size, entries}."""
    if not isinstance(value, list):
        return []
    pages = []
    for raw in value[:MAX_PAGES]:
        if not isinstance(raw, dict) or _int(raw.get("first_slot")) is None or not isinstance(raw.get("entries"), list):
            continue
        entries = []
        for e in raw["entries"][:MAX_ENTRIES]:
            if not isinstance(e, dict):
                continue
            row = e.get("row")
            entries.append(
                {
                    "op": _text(e.get("op")) or "?",
                    "site": _text(e.get("site")),
                    "row": row if type(row) is int or isinstance(row, str) else None,
                    "rid": _text(e.get("rid")),
                    "seq": _int(e.get("seq")),
                    "thread": _text(e.get("thread")),
                    "ago_ms": _int(e.get("ago_ms")),
                }
            )
        page_size = _int(raw.get("page_size")) or 1
        pages.append({"page": _int(raw.get("page")), "first_slot": raw["first_slot"], "page_size": max(1, page_size), "entries": entries})
    return pages


def slots_named(page: dict[str, Any]) -> str:
    first, size = page["first_slot"], page["page_size"]
    return f"slot {first}" if size == 1 else f"slots {first}-{first + size - 1} (page {page['page']})"


def entry_line(entry: dict[str, Any]) -> str:
    """`#421 free     row 63 (rid r7) by _finish (workload.py:203) < ...  [MainThread, 0.006s before]`"""
    seq = f"#{entry['seq']}" if entry["seq"] is not None else "#?"
    row = entry["row"]
    held = "" if row is None else f"row {row}" if type(row) is int else str(row)
    if held and entry.get("rid"):
        held += f" (rid {entry['rid']})"
    by = f" by {entry['site']}" if entry["site"] else ""
    when = []
    if entry["thread"]:
        when.append(entry["thread"])
    if entry["ago_ms"] is not None:
        when.append(f"{entry['ago_ms'] / 1000:.3f}s before")
    tail = f"  [{', '.join(when)}]" if when else ""
    return f"{seq:>8} {entry['op']:<12} {held:<7}{by}{tail}".rstrip()


def timeline(page: dict[str, Any], indent: str = "") -> list[str]:
    entries = page["entries"]
    head = f"{indent}history of {slots_named(page)}, oldest first ({len(entries)} transition(s) kept):"
    return [head] + [indent + "  " + entry_line(e) for e in entries]


def report_lines(evidence: dict[str, Any], indent: str) -> list[str]:
    """What a terminal report prints under a finding: the first pages' timelines, or why none."""
    pages = clean_pages(evidence.get(schema.SLOT_HISTORY))
    lines: list[str] = []
    for page in pages[:SHOWN_IN_REPORT]:
        lines += timeline(page, indent)
    if len(pages) > SHOWN_IN_REPORT:
        lines.append(f"{indent}(histories of {len(pages) - SHOWN_IN_REPORT} more page(s) in the JSON report)")
    off = evidence.get(schema.HISTORY_OFF)
    if not pages and isinstance(off, str) and off:
        lines.append(f"{indent}no slot history: {off}")
    return lines


def pages_for_slots(value: Any, slot_ids: Iterable[Any]) -> list[dict[str, Any]]:
    """The pages of a history that hold one of `slot_ids` (a finding that names part of a census)."""
    wanted = {i for i in slot_ids if type(i) is int}
    return [p for p in clean_pages(value) if any(p["first_slot"] <= i < p["first_slot"] + p["page_size"] for i in wanted)]


def find_slot(events: Iterable[schema.Event], slot: int) -> list[tuple[schema.Event, dict[str, Any]]]:
    """Every recorded history of `slot` in a trace's violations and censuses, in trace order."""
    found = []
    for event in events:
        if event.name not in (schema.VIOLATION, schema.CENSUS) or schema.SLOT_HISTORY not in event.args:
            continue
        for page in clean_pages(event.args.get(schema.SLOT_HISTORY)):
            if page["first_slot"] <= slot < page["first_slot"] + page["page_size"]:
                found.append((event, page))
    return found
