"""Which processes an analysis keeps when a trace names more than it can hold.

An analysis keeps state per process, so it holds at most `MAX_PROCESSES` of them at once. A trace
that names more (a fleet of short-lived workers sampled for hours, or a crafted file) must not
push out the one process whose slots leaked because it came late: processes are ranked by what
their events can tell, and a newcomer takes the place of the oldest one that tells less.

- SAMPLED: only memory samples and a sampler's header (its memory growth is all it can show);
- PROBED: the probe reported from it (its header, counters, status), but it never counted slots,
  or it is `run` itself (the run's header: what ran, the machine's memory);
- COUNTED: a census, a broken rule, or anything else a finding is made of.

What was set aside or not analysed is counted for the notes, and a COUNTED process that found no
room (more than `MAX_PROCESSES` of them) is counted apart: the gate cannot pass such a trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvdoctor.trace import schema
from kvdoctor.trace.counter_block import CounterBlock
from kvdoctor.units import as_count

MAX_PROCESSES = 4096  # processes analysed at once; a trace naming more is a fleet or crafted: the rest is noted

SAMPLED, PROBED, COUNTED = 0, 1, 2

_COUNTED_NAMES = frozenset(
    {
        schema.CENSUS,
        schema.VIOLATION,
        schema.RETAINED_VIEWS,
        schema.L3_KEYS,
        schema.CONNECTOR_OVERDUE,
        schema.CONNECTOR_LATE_RELEASE,
        schema.CONTAINER_SIZES,
        schema.HOST_GROWTH_SITES,
        schema.FIX_APPLIED,
    }
)
_PROBED_NAMES = frozenset(
    {schema.PROBE_STATUS, schema.PROBE_STATS, schema.LEDGER_COUNTER, schema.HICACHE_COUNTER, schema.MEMORY_CLASSES, schema.L3_COUNTER}
)


def level_of_block(block: CounterBlock) -> int:
    """`level_of` for a block of counter lines of one process, read only as far as needed."""
    if block.name != schema.PROBE_STATS:
        return level_of(block.name, {})
    if any("write_error" in layout.args for layout in block.layouts):
        return COUNTED
    dropped = block.numbers("dropped_events") if block.kind("dropped_events") in ("int", "float") else None
    if dropped is None:
        return max(level_of(block.name, event.args) for event in block.events(list(range(len(block)))))
    return COUNTED if any(as_count(n) for n in dropped) else PROBED


def level_of(name: str, args: dict[str, Any]) -> int:
    """What an event of this name (and these arguments) tells of its process: a probe that turned
    itself off, lost events or could not write is part of the verdict, like a census."""
    if name in _COUNTED_NAMES:
        return COUNTED
    if name == schema.PROBE_STATUS and args.get("state") in ("off", "partial"):
        return COUNTED
    if name == schema.PROBE_STATS and (args.get("write_error") or as_count(args.get("dropped_events"))):
        return COUNTED
    if name in _PROBED_NAMES:
        return PROBED
    if (name == schema.HEADER and args.get("probe")) or name == schema.RUN_HEADER:
        return PROBED
    return SAMPLED


class Admission:
    """The processes an analysis holds, at most `limit`, each with its level; `forget` is called
    with the pid of a process set aside to make room, so every sink drops what it kept of it."""

    def __init__(self, forget: Callable[[int], None], limit: int = MAX_PROCESSES) -> None:
        self.limit = limit
        self.levels: dict[int, int] = {}
        self._forget = forget
        self._oldest_first: tuple[dict[int, None], dict[int, None]] = ({}, {})  # SAMPLED and PROBED pids, in order of arrival
        self.set_aside = [0, 0]  # processes set aside, by level
        self.not_analysed = [0, 0, 0]  # events of processes that found no room, by level

    def take(self, pid: int, level: int, events: int = 1) -> bool:
        """Whether the `events` of `pid`, of this level, are analysed: a known process rises to
        the level, a new one joins while there is room, else in the place of the oldest process
        of a lower level."""
        known = self.levels.get(pid)
        if known is not None:
            if level > known:
                self._oldest_first[known].pop(pid, None)
                self._place(pid, level)
            return True
        if len(self.levels) >= self.limit:
            victim_level = next((lower for lower in range(min(level, COUNTED)) if self._oldest_first[lower]), None)
            if victim_level is None:
                self.not_analysed[level] += events
                return False
            victim = next(iter(self._oldest_first[victim_level]))
            del self._oldest_first[victim_level][victim]
            del self.levels[victim]
            self.set_aside[victim_level] += 1
            self._forget(victim)
        self._place(pid, level)
        return True

    def _place(self, pid: int, level: int) -> None:
        self.levels[pid] = level
        if level < COUNTED:
            self._oldest_first[level][pid] = None

    def notes(self) -> list[str]:
        """What the bound cost, in words; nothing when every process was analysed."""
        out = []
        sampled, probed = self.set_aside
        left = self.not_analysed[SAMPLED] + self.not_analysed[PROBED]
        if sampled or probed or left:
            aside = [f"{sampled} with only memory samples"] if sampled else []
            aside += [f"{probed} the probe reported from without counting slots"] if probed else []
            out.append(
                f"the trace names more than {self.limit} processes, more than one analysis holds: "
                + (f"{' and '.join(aside)} were set aside for processes whose slots the probe counted, and " if aside else "")
                + f"{left} event(s) of processes that found no room were not analysed (their memory growth is not judged)"
            )
        if self.not_analysed[COUNTED]:
            out.append(
                f"the trace names more than {self.limit} processes whose slots the probe counted: "
                f"{self.not_analysed[COUNTED]} event(s) of the others were not analysed, so their findings are not known"
            )
        return out
