"""How far each probe's record in a trace can vouch for the run, read alongside the detectors.

A verdict of "no leak, no double free" stands only on a record that reaches the end: a probe that
turned itself off, dropped events or stopped writing (a full disk) left a record that stops early,
so a clean census before that cannot vouch for what came after; a ledger that held slots but was
never counted whole has no orphan verdict at all; and events from a process whose probe header is
missing or damaged belong to no engine the gate can name. The gate turns each of these into
"could not judge" with the reason (kvdoctor.analysis.gate).
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.probe_health import WHOLE_PROBE
from kvdoctor.trace import schema
from kvdoctor.trace.counter_block import CounterBlock
from kvdoctor.units import as_count

MAX_LEDGERS = 4096  # (pid, allocator) pairs followed; the analyzer already bounds the pids


class ProbeRecord:
    """Per process: whether its probe's record stopped early, and which of its ledgers held slots."""

    consumes = frozenset({schema.CENSUS, schema.LEDGER_COUNTER, schema.PROBE_STATUS, schema.PROBE_STATS, schema.VIOLATION})
    counter_state_apart = True  # it keeps maxima and firsts, which no order of feeding changes

    def __init__(self) -> None:
        self.probe_pids: set[int] = set()  # processes that wrote events only a probe writes
        self.off: dict[int, tuple[float, str]] = {}  # pid: (when, why) the whole probe turned itself off
        self.dropped: dict[int, int] = {}  # pid: most events dropped
        self.write_error: dict[int, str] = {}
        self.held: dict[tuple[int, str], int] = {}  # (pid, allocator): most slots the ledger saw held (owned or in the tree)
        self.counted: set[tuple[int, str]] = set()  # (pid, allocator): had a census, readable or not
        self.last_census_ts: dict[int, float] = {}
        self.said_by_run: dict[int, str] = {}  # pid: a writer stop `run` learnt of (the trace could not say it)

    def feed(self, event: schema.Event) -> None:
        args, pid = event.args, event.pid
        self.probe_pids.add(pid)
        if event.name == schema.CENSUS:
            if len(self.counted) < MAX_LEDGERS:
                self.counted.add((pid, str(args.get("allocator", ""))))
            self.last_census_ts[pid] = max(self.last_census_ts.get(pid, 0.0), float(event.ts or 0.0))
        elif event.name == schema.LEDGER_COUNTER:
            self._held(pid, str(args.get("allocator", "")), as_count(args.get("owned_slots")) + as_count(args.get("tree_slots")))
        elif event.name == schema.PROBE_STATUS:
            if args.get("state") == "off" and str(args.get("component") or "ledger") in WHOLE_PROBE and pid not in self.off:
                self.off[pid] = (float(event.ts or 0.0), str(args.get("reason", ""))[:200])
        elif event.name == schema.PROBE_STATS:
            self.dropped[pid] = max(self.dropped.get(pid, 0), as_count(args.get("dropped_events")))
            if args.get("write_error") and pid not in self.write_error:
                self.write_error[pid] = str(args["write_error"])[:200]

    def stopped_writing(self, value: Any) -> None:
        """The writers `run` learnt had stopped ({"pid": reason}, from the trace's end event)."""
        for pid_text, reason in list(value.items())[:MAX_LEDGERS] if isinstance(value, dict) else []:
            if str(pid_text).isascii() and str(pid_text).isdigit():  # `²` passes isdigit and fails int
                pid = int(pid_text)
                self.said_by_run[pid] = str(reason)[:200] or "a write failed"
                self.write_error.setdefault(pid, self.said_by_run[pid])

    def _held(self, pid: int, allocator: str, owned: int) -> None:
        key = (pid, allocator)
        if key in self.held or len(self.held) < MAX_LEDGERS:
            self.held[key] = max(self.held.get(key, 0), owned)

    def feed_counter_block(self, block: CounterBlock) -> None:
        """`feed` for each line of one process's counter block, read by columns where they are plain numbers."""
        if block.name not in (schema.LEDGER_COUNTER, schema.PROBE_STATS):
            return
        self.probe_pids.add(block.pid)
        if block.name == schema.PROBE_STATS:
            dropped = _column(block, "dropped_events")
            if dropped is None or any("write_error" in layout.args for layout in block.layouts):
                self._feed_lines(block)
            else:
                self.dropped[block.pid] = max(self.dropped.get(block.pid, 0), max(map(as_count, dropped), default=0))
            return
        owned = _column(block, "owned_slots")
        in_tree = _column(block, "tree_slots") if any("tree_slots" in layout.args for layout in block.layouts) else [0] * len(block)
        if owned is None or in_tree is None:
            self._feed_lines(block)
            return
        self._held(block.pid, block.allocator, max((as_count(o) + as_count(t) for o, t in zip(owned, in_tree, strict=False)), default=0))

    def _feed_lines(self, block: CounterBlock) -> None:
        for index in range(len(block)):
            self.feed(block.event(index))

    def stopped_early(self) -> dict[int, str]:
        """pid -> why its probe's record does not reach the end of the run."""
        out: dict[int, list[str]] = {}
        for pid, (ts, reason) in sorted(self.off.items()):
            census = self.last_census_ts.get(pid)
            when = (
                f"{(ts - census) / 1e6:.1f} s after its last census" if census is not None and ts >= census else "before any census of it"
            )
            out.setdefault(pid, []).append(f"the probe turned itself off {when} ({reason})")
        for pid, count in sorted(self.dropped.items()):
            if count:
                out.setdefault(pid, []).append(f"it dropped {count} trace event(s) (the writer fell behind)")
        for pid, error in sorted(self.write_error.items()):
            out.setdefault(pid, []).append(f"it stopped writing its trace ({error})")
        return {pid: "; ".join(reasons) for pid, reasons in out.items()}

    def uncounted(self) -> dict[str, str]:
        """ "pid N allocator" -> why that ledger has no orphan verdict: it held slots, no census came."""
        return {
            f"pid {pid} {allocator}".rstrip(): f"its ledger held up to {most} slot(s) and no census counted it"
            for (pid, allocator), most in sorted(self.held.items())
            if most and (pid, allocator) not in self.counted
        }

    def unheaded(self, processes: dict[int, dict[str, Any]]) -> list[int]:
        """The processes that wrote probe events but have no readable probe header (missing, or one
        that names no engine kvdoctor probes): their events belong to no engine the gate can name."""
        return sorted(
            pid
            for pid in self.probe_pids
            if not ((processes.get(pid) or {}).get("probe") and (processes.get(pid) or {}).get("engine") in schema.SERVING_ENGINES)
        )


def _column(block: CounterBlock, key: str) -> list[Any] | None:
    """Argument `key` of every line of the block when it is a number in all of them, else None."""
    return block.numbers(key) if block.kind(key) in ("int", "float") else None
