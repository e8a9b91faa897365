"""The protocols of what an analysis feeds (sinks, detectors, the bulk feed of counter lines), and
the shared shape of detectors that read the probe's violations."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from kvdoctor.analysis.findings import ERROR, Finding
from kvdoctor.analysis.named import merge_named
from kvdoctor.analysis.slot_history import clean_pages
from kvdoctor.trace import schema
from kvdoctor.trace.counter_block import CounterBlock
from kvdoctor.units import as_count

MAX_LEDGER_ENTRIES = 1024  # (process, allocator[, call site]) entries one table keeps; a trace naming more is crafted
MAX_LABELS_COUNTED = 1 << 18  # entries left out, counted one by one up to this many


class LeftOut:
    """What a detector's table did not keep once full: how many entries (distinct keys, counted
    exactly up to MAX_LABELS_COUNTED), events and counts. Nothing is dropped without a word: it
    becomes one finding of its own, with the count the user budgets against."""

    def __init__(self) -> None:
        self._keys: set[int] = set()
        self.events = 0
        self.count = 0

    def add(self, key: Any, count: int) -> None:
        if len(self._keys) < MAX_LABELS_COUNTED:
            self._keys.add(hash(key))
        self.events += 1
        self.count += count

    def entries(self) -> str:
        many = len(self._keys)
        return f"at least {many}" if many >= MAX_LABELS_COUNTED else str(many)

    def __bool__(self) -> bool:
        return self.events > 0


class Sink(Protocol):
    """What an analysis feeds events to: every detector, and the series and probe record beside
    them. A sink with a `consumes` set (frozenset of event names) is fed only those; one with a
    `forget(pid)` drops a process the analysis sets aside (kvdoctor.analysis.admission)."""

    def feed(self, event: schema.Event) -> None: ...


class Detector(Sink, Protocol):
    def findings(self) -> list[Finding]: ...


@runtime_checkable
class CounterBlockSink(Sink, Protocol):
    """A sink that also takes counter lines in bulk. A replay gathers the counter lines of one
    (name, pid, allocator) that come between the other events the sink reads and hands them over
    unparsed (kvdoctor.trace.counter_block): `feed_counter_block(block)` must leave the sink as
    `feed` of each line in turn would, parsing only what it keeps. A counter name goes in bulk only
    when every sink that reads it is one of these.

    `counter_state_apart`: what the sink keeps of counters changes nothing its other events read
    (maxima, firsts), so gathered lines need not be handed over before those events."""

    consumes: frozenset[str]
    counter_state_apart: bool

    def feed_counter_block(self, block: CounterBlock) -> None: ...


def reads(sink: Sink, name: str) -> bool:
    """A sink reads the event names in its `consumes` set; one without the set reads everything."""
    consumes: frozenset[str] | None = getattr(sink, "consumes", None)
    return consumes is None or name in consumes


class ViolationDetector:
    """Aggregates the probe's `violation` events of one kind per (process, allocator, call site)."""

    consumes = frozenset({schema.VIOLATION})

    kind = ""
    severity = ERROR
    template = ""
    merged_counts: tuple[str, ...] = ("requests", "sites", "allocated_at")  # evidence tables summed over a group's events
    unit = ""  # what the count counts, as the finding names it ("slots", "last_loc values")
    paged = False  # the count is of KV slots kept by the ledger a page at a time (see slot_count)

    def __init__(self) -> None:
        self.groups: dict[tuple[int, str, str], dict[str, Any]] = {}
        self.left_out = LeftOut()  # groups beyond MAX_LEDGER_ENTRIES

    def feed(self, event: schema.Event) -> None:
        if event.name != schema.VIOLATION or event.args.get("kind") != self.kind:
            return
        args = event.args
        key = (event.pid, str(args.get("allocator", "")), str(args.get("site", "")))
        group = self.groups.get(key)
        count = slot_count(args) if self.paged else as_count(args.get("count"))
        if group is None:
            if len(self.groups) >= MAX_LEDGER_ENTRIES:
                self.left_out.add(key, count)
                return
            self.groups[key] = {"count": count, "first": dict(args), "events": 1, "first_ts_us": event.ts}
            self.groups[key]["page_size"] = max(1, as_count(args.get("page_size"))) if self.paged else 1
        else:
            group["count"] += count
            group["events"] += 1
            merged = as_list(group["first"].get("slot_ids")) + as_list(args.get("slot_ids"))
            group["first"]["slot_ids"] = list(dict.fromkeys(i for i in merged if isinstance(i, (int, str))))[:64]
            for name in self.merged_counts:
                if isinstance(args.get(name), dict):
                    merge_named(group["first"], name, args[name])  # bounded however many events name new requests
                elif not isinstance(group["first"].get(name), dict):
                    group["first"][name] = {}

    def findings(self) -> list[Finding]:
        out = []
        for (pid, allocator, site), group in self.groups.items():
            evidence = {k: v for k, v in group["first"].items() if k not in ("kind", "count")}
            evidence["events"] = group["events"]
            evidence["pid"] = pid
            if schema.SLOT_HISTORY in evidence:  # the first event's flight recorder, its fields checked
                evidence[schema.SLOT_HISTORY] = clean_pages(evidence[schema.SLOT_HISTORY])
            message = self.message(group["count"], allocator, site, evidence)
            found = Finding(self.kind, self.severity, message, group["count"], evidence, pid, first_ts_us=group["first_ts_us"])
            found.unit, found.page_size = self.unit, group["page_size"]
            out.append(found)
        if self.left_out:
            out.append(left_out_finding(self.kind, self.severity, self.left_out, "(process, allocator, call site)"))
            out[-1].unit = self.unit
        return out

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        """The finding's sentence: `template` filled with the count, allocator, site, the slots
        (" (slots 5, 6, ...)") and the request that holds most of them; override for more."""
        return self.template.format(count=count, allocator=allocator, site=site, slots=ids_text(evidence), request=first_request(evidence))


def left_out_finding(kind: str, severity: str, left: LeftOut, entry: str) -> Finding:
    """The one finding that stands for the entries a full table did not keep, with their count."""
    return Finding(
        kind,
        severity,
        f"{left.count} more {kind} (in {left.events} event(s)) in {left.entries()} {entry} entries beyond the "
        f"{MAX_LEDGER_ENTRIES} one analysis names one by one",
        left.count,
        {"entries_not_kept": left.entries(), "events": left.events},
        0,
    )


def slot_count(args: dict[str, Any]) -> int:
    """The slots a violation event names. The ledger keeps one state a page, and at a page size
    above one the probe's `count` is of the entries it checked: slots for some calls, page starts
    for others (an extend checks only the pages it begins). So there the count is the slots of the
    pages hit (the pages its `sites` tally names, exact up to 4096 an event) times the page size,
    or the count where that is more (a slot checked twice)."""
    count = as_count(args.get("count"))
    page_size = as_count(args.get("page_size"))
    sites = args.get("sites")
    if page_size <= 1 or not isinstance(sites, dict):
        return count
    pages = sum(as_count(n) for n in sites.values())
    return max(pages * page_size, count)


def as_list(value: Any) -> list[Any]:
    """Evidence lists from a trace we did not write ourselves may be anything."""
    return list(value) if isinstance(value, list) else []


def first_request(evidence: dict[str, Any]) -> str:
    requests = evidence.get("requests")
    if isinstance(requests, dict) and requests:
        return str(max(requests, key=lambda k: as_count(requests[k])))
    return "unknown request"


def ids_text(evidence: dict[str, Any], key: str = "slot_ids", limit: int = 8) -> str:
    ids = as_list(evidence.get(key))
    if not ids:
        return ""
    shown = ", ".join(str(i) for i in ids[:limit])
    return f" (slots {shown}{', ...' if len(ids) > limit else ''})"
