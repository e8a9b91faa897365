"""The request rows (SGLang's req_pool_idx) that are live, and the request id each one serves.

The slot ledger names a slot's owner by its row; this table turns a row into "rid X, live" or
"rid X, finished" for the evidence, with a bounded memory of finished rows. A row serves many
requests in turn, so a slot history's entry (history.py) names its row's owner *then*: each row keeps
its last owners, each stamped with the recorders' sequence number at its allocation.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from kvdoctor.probe.ledgers import history
from kvdoctor.trace import schema

MAX_FINISHED_ROWS = 4096  # finished rows remembered for evidence (bounded)
OWNERS_KEPT = history.OWNERS_KEPT  # a row's last owners, for the slot histories' entries
BEFORE_ATTACH = -2  # the owner of slots held by no one when the probe adopted the allocator
RELEASED = -3  # the owner of slots a request still held when it gave back its row (its row may serve another now)
# the rid of a row taken by count (SGLang before 0.5.9): the pool never sees the request
RID_NOT_PASSED = "not passed to the pool before SGLang 0.5.9"
# the owner of slots held when the probe adopted the allocator whose books did not add up against the
# engine's own counters (a holder it could not see): never judged, as nothing proves them lost
UNPROVEN = -4
# the owner of slots a row still held at its release while a forward it was in was in flight (overlap
# scheduling frees them when it processes that forward's result): held, judged once it was processed
IN_FLIGHT = -5
ORPHANED_OWNERS = (BEFORE_ATTACH, RELEASED)  # owners that make an owned slot an orphan at any census


class RequestTable:
    """Which request rows (req_pool_idx) are live, and the request id each one serves.

    Changed by the scheduler's thread and read by the writer thread's rolling census: changes and
    `live_rows()` hold a lock. The native path makes the same changes on `live` and `finished`
    themselves (its context.c, `context_row_allocated`, `context_row_freed`), holding the GIL
    from the first to the last with no Python code between them, which orders them as the lock
    does; so neither dict may be replaced, only changed."""

    max_finished = MAX_FINISHED_ROWS
    # what the native path calls and reads here, by operation (context.c's keys)
    native_names = {
        "row_allocated": "allocated",
        "row_freed": "freed",
        "rows_live": "live",
        "rows_finished": "finished",
        "rows_kept": "max_finished",
        "rows_holders": "holders",
        "rows_owners": "owners",
        "rows_owners_kept": "owners_kept",
        "rows_clock": "clock",
    }
    owners_kept = OWNERS_KEPT

    def __init__(self) -> None:
        self.live: dict[int, str] = {}
        self.finished: dict[int, str] = {}
        # live row -> a weak reference to the request that took it (not for rows taken by count, or
        # held when the probe came): a row whose request is gone, its free never seen, is left
        self.holders: dict[int, weakref.ref[Any]] = {}
        # row -> its last owners, oldest first: (the recorders' last sequence number when it was
        # taken, rid); with the recorder off, no clock and none kept
        self.owners: dict[int, list[tuple[int, str]]] = {}
        self.clock = history.CLOCK if history.entries_wanted() else None
        self._lock = threading.Lock()

    def allocated(self, index: int, rid: str, holder: Any = None) -> None:
        try:
            ref = weakref.ref(holder) if holder is not None else None
        except TypeError:  # a type without weak references: its row is not judged
            ref = None
        with self._lock:
            self.live[index] = rid
            self.finished.pop(index, None)
            if ref is not None:
                self.holders[index] = ref
            else:
                self.holders.pop(index, None)
            if self.clock is not None:
                log = self.owners.setdefault(index, [])
                log.append((int(self.clock[0]) & 0xFFFFFFFF, rid))
                if len(log) > self.owners_kept:
                    del log[0]

    def freed(self, index: int) -> None:
        with self._lock:
            self.holders.pop(index, None)
            rid = self.live.pop(index, None)
            if rid is not None:
                self.finished[index] = rid
                if len(self.finished) > self.max_finished:  # forget the oldest finished rows
                    self.finished.pop(next(iter(self.finished)))

    def cleared(self) -> None:
        for index in list(self.live):
            self.freed(index)

    def left_rows(self) -> dict[int, str]:
        """Live rows whose request object is gone though no free of the row was seen: {row: rid}.
        Rows without a holder are not judged. (A request that still lives but names no row is not
        judged either: SGLang's streaming sessions move a row's record to the session, `detach_kv`.)"""
        with self._lock:  # each copy one C call, so the native path (holding the GIL, not the lock) never changes it midway
            live, holders = dict(self.live), dict(self.holders)
        return {index: rid for index, rid in live.items() if (ref := holders.get(index)) is not None and ref() is None}

    def owner_at(self, index: int, seq: int) -> str | None:
        """The rid row `index` served at a recorder's entry of sequence number `seq` (the entry's call
        came after that owner took the row, and before the next one did), or None: the row was taken
        before kvdoctor saw it, or by an owner older than the ones kept."""
        with self._lock:
            log = list(self.owners.get(index, ()))
        for stamp, rid in reversed(log):
            if 0 < ((seq - stamp) & 0xFFFFFFFF) < 1 << 31:
                return rid
        return None

    def live_rows(self) -> list[int]:
        with self._lock:
            return list(self.live)

    def describe(self, index: int) -> str:
        if index == BEFORE_ATTACH:
            return schema.OWNER_BEFORE_ATTACH
        if index == UNPROVEN:
            return "held when kvdoctor attached, by a holder it could not prove (not judged)"
        if index == IN_FLIGHT:
            return "a request that gave back its row while a forward it was in was in flight (overlap scheduling)"
        if index == RELEASED:
            return "a request that released its row without freeing them (leaked at release)"
        if index < 0:
            return "unknown request"
        if index in self.live:
            return f"req_pool_idx {index} (rid {self.live[index]}, live)"
        if index in self.finished:
            return f"req_pool_idx {index} (last used by rid {self.finished[index]}, finished)"
        return f"req_pool_idx {index}"

    @property
    def idle(self) -> bool:
        return not self.live
