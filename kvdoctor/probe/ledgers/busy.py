"""Leaks named while the server is busy: at a request's release, and by rolling censuses.

A production server is rarely idle, and an idle census is when the slot ledger used to name
leaks. Two checks need no idle moment:

- **At release.** SGLang frees a request's slots (or gives them to the radix tree) before it
  gives back the request's row. The slots the row pointed at (`req_to_token[row, :n]`, `n` the
  furthest position written to it) that are still owned by that row when it is released are
  leaked, now, with the request that leaked them.
  Where a forward in flight may still free some of them (overlap scheduling), they are held
  (`held_in_flight`) and judged once it was processed (`leaked_in_flight`; probe/engines/sglang/release_paths.py).
- **Rolling census.** Every few seconds a copy of the ledger (asynchronous on a GPU) is read:
  pages owned by a row that is no longer live, or allocated and never written to any row. Only
  pages that stay so, unchanged, across two censuses are named: a request caught between its
  allocation and its row write, or between its frees and its release, is not a leak.
  A census is emitted when its verdict changes, and a clean one at least every
  ROLLING_REPORT_S: a process killed outright (SIGKILL, the OOM killer) leaves a verdict at most
  that old (plus one interval) in the trace.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvdoctor.probe.base.vocabulary import OWNED
from kvdoctor.probe.ledgers import history as rec
from kvdoctor.probe.ledgers.requests import IN_FLIGHT, RELEASED, UNPROVEN
from kvdoctor.probe.ledgers.slots import SlotLedger
from kvdoctor.trace import schema

ROLLING_CENSUS_INTERVAL_S = 5.0
ROLLING_REPORT_S = 30.0  # an unchanged verdict is still emitted this often


def leaked_at_release(ledger: SlotLedger, slots: Any, row: int, rid: str) -> dict[str, Any] | None:
    """The violation for the slots a released row still owns (host ledgers), or None (also for a
    ledger that is not judged: its rows may not be the only holders the probe cannot see)."""
    if ledger.not_judged:
        return None
    with ledger.lock:
        still = _still_owned(ledger, slots, row)
        return None if still is None else _leaked(ledger, still, row, rid)


def held_in_flight(ledger: SlotLedger, slots: Any, row: int) -> Any:
    """The pages a released row still owns, now held for the forward in flight (owner IN_FLIGHT:
    the next request in the row does not inherit them, and no busy census counts them), or None."""
    if ledger.not_judged:
        return None
    with ledger.lock:
        still = _still_owned(ledger, slots, row)
        if still is not None:
            ledger.owner[still] = IN_FLIGHT
        return still


def leaked_in_flight(ledger: SlotLedger, pages: Any, row: int, rid: str) -> dict[str, Any] | None:
    """Of the pages `held_in_flight` kept for a release, the violation for those still held."""
    if ledger.not_judged:
        return None
    with ledger.lock:
        still = pages[(ledger.state[pages] == OWNED) & (ledger.owner[pages] == IN_FLIGHT)]
        return _leaked(ledger, still, row, rid) if still.size else None


def _still_owned(ledger: SlotLedger, slots: Any, row: int) -> Any:
    pages = np.unique(ledger.xp.index(slots) // ledger.page_size)
    pages = pages[(pages > 0) & (pages <= ledger.num_pages)]
    still = pages[(ledger.state[pages] == OWNED) & (ledger.owner[pages] == row)]
    return still if still.size else None


def _leaked(ledger: SlotLedger, still: Any, row: int, rid: str) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": schema.ORPHAN_SLOTS,
        "when": "release",
        "allocator": ledger.name,
        "count": int(still.size) * ledger.page_size,
        "page_size": ledger.page_size,
        "request": f"req_pool_idx {row} (rid {rid})",
        "note": "still owned by the request when it gave back its row: never freed nor inserted into the tree",
    }
    args.update(ledger.readback._page_evidence(still, ledger.owner, ledger.alloc_site))
    args.update(rec.evidence(ledger, still))  # their histories now, while the row's owner log still names the request
    ledger.owner[still] = RELEASED  # no longer the row's: the next request in that row must not inherit them
    args["requests"] = {args["request"]: args["count"]}  # the row's request now, not whoever uses the row later
    return args


class RollingCensus:
    """The rolling census of one ledger: a snapshot every interval, evaluated when it has landed."""

    def __init__(self, ledger: SlotLedger, interval_s: float = ROLLING_CENSUS_INTERVAL_S, blind: str = "") -> None:
        self.ledger = ledger
        self.blind = blind  # why this ledger's rolling census cannot judge (its rows do not name its slots): none is taken
        self.interval_s = interval_s
        self.next_s = time.monotonic() + interval_s
        self._pending: Any = None
        self._pending_live: list[int] = []
        self._pending_s = 0.0
        self._previous: dict[int, tuple[int, int]] = {}
        self._reported: tuple[int, ...] | None = None
        self._reported_s = -1e9
        self.last: dict[str, Any] | None = None  # the last census evaluated, emitted or not
        self.last_s = 0.0  # when its snapshot was taken (monotonic)

    def tick(self, live_rows: list[int]) -> dict[str, Any] | None:
        """Called from the writer thread; returns the census to emit when its verdict changed."""
        ledger = self.ledger
        if self.blind:
            return None
        if self._pending is None:
            if time.monotonic() < self.next_s:
                return None
            self.next_s = time.monotonic() + self.interval_s
            with ledger.lock:
                self._pending = ledger.xp.snapshot([ledger.state, ledger.owner, ledger.alloc_site])
                self._pending_live = live_rows
                self._pending_s = time.monotonic()
            if not self._pending.ready():
                return None
        elif not self._pending.ready():
            return None
        state, owner, alloc_site = self._pending.get()
        live = np.array(self._pending_live, dtype=np.int64)
        self._pending = None
        body = slice(1, ledger.num_pages + 1)
        unproven = (state[body] == OWNED) & (owner[body] == UNPROVEN)  # adopted, holder not proven: never judged
        owned = (state[body] == OWNED) & ~unproven
        unowned_or_dead = (owner[body] < 0) | ~np.isin(owner[body], live)
        pages = np.nonzero(owned & unowned_or_dead)[0] + 1
        current = {int(p): (int(owner[p]), int(alloc_site[p])) for p in pages}
        persisted = np.array(sorted(p for p, sign in current.items() if self._previous.get(p) == sign), dtype=np.int64)
        self._previous = current
        key = tuple(int(p) for p in persisted[:64]) + (int(persisted.size),)
        counts = ledger.counts(state)
        counts.pop("tree_freed_slots")  # judged at idle and exit only: a rolling census is not a tree audit
        self.last_s = self._pending_s
        self.last = {
            "allocator": ledger.name,
            "reason": "rolling",
            "idle": False,
            "page_size": ledger.page_size,
            "live_requests": len(live),
            **counts,
            "orphan_slots": int(persisted.size) * ledger.page_size,
            "orphan_slot_ids": ledger.readback._slot_ids(persisted),
            "orphan_allocated_at": ledger.readback._alloc_sites(alloc_site, persisted),
            "orphan_requests": ledger.readback._requests(owner, persisted),
            "unproven_slots": int(np.count_nonzero(unproven)) * ledger.page_size,
            "persisted_s": self.interval_s,
            **ledger.readback.before_attach(persisted, owner),
        }
        if ledger.not_judged:
            self.last.update(judged=False, not_judged=ledger.not_judged)
        elif ledger.readback.tree_unseen:  # the tree's own count, read on the engine's thread, disagreed last
            self.last.update(judged=False, not_judged=ledger.readback.tree_unseen)
        now = time.monotonic()
        if key == self._reported and now - self._reported_s < ROLLING_REPORT_S:
            return None
        self._reported, self._reported_s = key, now
        return self.last
