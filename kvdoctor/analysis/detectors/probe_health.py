"""probe_health: when the probe turned itself off, lost events, or its ledger disagreed with the host."""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import MAX_LEDGER_ENTRIES, LeftOut, as_list, left_out_finding
from kvdoctor.analysis.findings import INFO, WARNING, Finding
from kvdoctor.trace import schema
from kvdoctor.trace.counter_block import CounterBlock
from kvdoctor.units import as_count

# Components whose turning off is the whole probe's; any other (attribution, memory classes, the
# container walk, ...) stops alone and the ledgers go on: said as a partial probe, not an off one.
WHOLE_PROBE = frozenset({"ledger", "attach"})
MAX_PARTS_OFF = 256


class ProbeHealthDetector:
    """Everything that makes the other findings less complete than they look, per process."""

    consumes = frozenset({schema.VIOLATION, schema.PROBE_STATUS, schema.PROBE_STATS, schema.CENSUS, schema.FIX_APPLIED})
    # What probe stats change (drops, write errors) is apart from what the other events change:
    # a replay may hand over gathered probe stats after events that followed them.
    counter_state_apart = True

    def __init__(self) -> None:
        self.off: dict[int, str] = {}  # pid: why the probe turned itself off
        self.partial: dict[int, str] = {}  # pid: what it could not hook
        self.unproven: dict[tuple[int, str], str] = {}  # (pid, allocator): why an adopted state is not judged
        self.parts_off: dict[tuple[int, str], tuple[str, bool]] = {}  # (pid, component): why that part alone stopped, for cost
        self.dropped: dict[int, int] = {}  # pid: most events dropped so far
        self.write_error: dict[int, str] = {}
        self.disagree: dict[tuple[int, str], dict[str, Any]] = {}  # (pid, allocator): the census
        self.tree_unseen: dict[tuple[int, str], dict[str, Any]] = {}  # (pid, allocator): the census its tree outgrew
        self.fixes: dict[tuple[int, str], int] = {}  # (pid, fix): corrections made
        self.pids_with_violations: set[int] = set()
        # entries beyond the tables' bounds (a crafted trace), by the finding kind they would make
        self.left_out: dict[str, LeftOut] = {}

    def _room(self, table: dict[Any, Any], key: Any, kind: str, limit: int = MAX_LEDGER_ENTRIES) -> bool:
        """Whether `table` takes `key`; a key it has no room for is counted under `kind`."""
        if key in table or len(table) < limit:
            return True
        self.left_out.setdefault(kind, LeftOut()).add(key, 0)
        return False

    def feed(self, event: schema.Event) -> None:
        args = event.args
        if event.name == schema.VIOLATION:
            self.pids_with_violations.add(event.pid)
        elif event.name == schema.PROBE_STATUS:
            state = args.get("state")
            component = str(args.get("component") or "ledger")
            if state == "off" and component not in WHOLE_PROBE:
                if self._room(self.parts_off, (event.pid, component), schema.PROBE_PARTIAL, MAX_PARTS_OFF):
                    self.parts_off.setdefault(
                        (event.pid, component), (str(args.get("reason", "")), args.get("cause") == schema.OFF_FOR_COST)
                    )
            elif state == "off":
                self.off.setdefault(event.pid, str(args.get("reason", "")))
            elif state == "partial" and component == "adoption":
                key = (event.pid, str(args.get("allocator", "")))
                if self._room(self.unproven, key, schema.PROBE_PARTIAL):
                    self.unproven[key] = str(args.get("reason", ""))
            elif state == "partial":
                self.partial[event.pid] = str(args.get("reason", ""))
        elif event.name == schema.PROBE_STATS:
            self.dropped[event.pid] = max(self.dropped.get(event.pid, 0), as_count(args.get("dropped_events")))
            if args.get("write_error"):
                self.write_error[event.pid] = str(args["write_error"])
        elif event.name == schema.CENSUS and as_count(args.get("ledger_disagrees_slots")):
            key = (event.pid, str(args.get("allocator")))
            if self._room(self.disagree, key, schema.LEDGER_DISAGREES):
                self.disagree[key] = args
        if event.name == schema.CENSUS and as_count(args.get("tree_unseen_slots")):
            key = (event.pid, str(args.get("allocator")))
            if self._room(self.tree_unseen, key, schema.PROBE_PARTIAL):
                self.tree_unseen[key] = args
        elif event.name == schema.FIX_APPLIED:
            key = (event.pid, str(args.get("fix")))
            if self._room(self.fixes, key, schema.FIX_APPLIED):
                self.fixes[key] = self.fixes.get(key, 0) + max(1, as_count(args.get("count")))

    def forget(self, pid: int) -> None:
        """Drops a process the analysis set aside (one that never lost events nor turned anything
        off: kvdoctor.analysis.admission keeps those)."""
        self.dropped.pop(pid, None)
        self.write_error.pop(pid, None)

    def feed_counter_block(self, block: CounterBlock) -> None:
        """`feed` for each line of one process's counter block: the most dropped events is all
        a block of probe stats changes, unless its lines carry a write error."""
        if block.name != schema.PROBE_STATS:
            return
        dropped = block.numbers("dropped_events") if block.kind("dropped_events") in ("int", "float") else None
        if dropped is None or any("write_error" in layout.args for layout in block.layouts):
            for index in range(len(block)):
                self.feed(block.event(index))
            return
        most = as_count(max(dropped))  # as_count never decreases as its number grows
        self.dropped[block.pid] = max(self.dropped.get(block.pid, 0), most)

    def findings(self) -> list[Finding]:
        out = []
        for pid, reason in self.off.items():
            out.append(
                Finding(
                    schema.PROBE_OFF, WARNING, f"the probe turned itself off in pid {pid}: {reason}", 0, {"reason": reason, "pid": pid}, pid
                )
            )
        for (pid, component), (reason, for_cost) in self.parts_off.items():
            out.append(
                Finding(
                    schema.PROBE_PARTIAL,
                    INFO if for_cost else WARNING,
                    f"one part of the probe ({component}) turned itself off in pid {pid}"
                    + (", as reading it cost more than it may" if for_cost else "")
                    + f"; the ledgers go on: {reason}",
                    0,
                    {"reason": reason, "component": component, "pid": pid, "for_cost": for_cost},
                    pid,
                )
            )
        for pid, reason in self.partial.items():
            out.append(
                Finding(
                    schema.PROBE_PARTIAL,
                    WARNING,
                    f"the probe hooked only part of the engine in pid {pid}: {reason}",
                    0,
                    {"reason": reason, "pid": pid},
                    pid,
                )
            )
        for (pid, allocator), args in self.tree_unseen.items():
            reason = str(args.get("not_judged", ""))
            out.append(
                Finding(
                    schema.PROBE_PARTIAL,
                    WARNING,
                    f"the ledger of {allocator} in pid {pid} cannot judge leaks: {reason} (the {args.get('reason', '')} census)",
                    0,
                    {"reason": reason, "pid": pid, "allocator": allocator, "tree_unseen_slots": as_count(args.get("tree_unseen_slots"))},
                    pid,
                )
            )
        for (pid, allocator), reason in self.unproven.items():
            out.append(
                Finding(
                    schema.PROBE_PARTIAL,
                    WARNING,
                    f"pid {pid}: {reason}",
                    0,
                    {"reason": reason, "component": "adoption", "allocator": allocator, "pid": pid},
                    pid,
                )
            )
        for pid, count in self.dropped.items():
            if count:
                out.append(
                    Finding(
                        schema.EVENTS_DROPPED,
                        WARNING,
                        f"pid {pid} dropped {count} trace event(s) because the writer fell behind; counts may be low",
                        count,
                        {"pid": pid},
                        pid,
                        unit="events",
                    )
                )
        for pid, err in self.write_error.items():
            out.append(
                Finding(
                    schema.TRACE_WRITE_FAILED, WARNING, f"pid {pid} stopped writing its trace: {err}", 0, {"error": err, "pid": pid}, pid
                )
            )
        for (pid, allocator), args in self.disagree.items():
            if pid in self.pids_with_violations:
                continue  # explained: double frees and double allocations put duplicates in the free list
            n = as_count(args.get("ledger_disagrees_slots"))
            host_only = as_list(args.get("free_only_in_host_slot_ids"))
            ledger_only = as_list(args.get("free_only_in_ledger_slot_ids"))
            out.append(
                Finding(
                    schema.LEDGER_DISAGREES,
                    WARNING,
                    f"the ledger of {allocator} disagrees with the allocator's own free list on {n} slot(s) at the "
                    f"{args.get('reason', '')} census (free only in the allocator: {host_only[:8]}; free only in the ledger: "
                    f"{ledger_only[:8]}): a path kvdoctor does not hook moved slots, so its slot findings there are not trusted",
                    n,
                    {
                        "allocator": allocator,
                        "pid": pid,
                        "slot_ids": list(host_only) + list(ledger_only),
                        "free_only_in_host_slot_ids": host_only,
                        "free_only_in_ledger_slot_ids": ledger_only,
                    },
                    pid,
                )
            )
        out += [
            left_out_finding(kind, INFO if kind == schema.FIX_APPLIED else WARNING, left, "(process, part)")
            for kind, left in self.left_out.items()
        ]
        for (pid, fix), count in self.fixes.items():
            out.append(
                Finding(
                    schema.FIX_APPLIED,
                    INFO,
                    f"fix {fix} corrected the host {count} time(s) in pid {pid}",
                    count,
                    {"fix": fix, "pid": pid},
                    pid,
                )
            )
        return out
