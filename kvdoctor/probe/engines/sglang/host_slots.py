"""The slots of a HiCache host (L2) pool: each page is free or handed out, and one handed out twice,
or given back twice, is named at the call, with the sites of both.

A host pool (`HostKVCache`) gives its slots to device-to-host backups, L3 prefetches and load-backs,
and takes them back with `free(indices)`, which appends what it is given to its free list: up to
0.5.22 with no check at all, in 0.5.23 with a check across calls (a free of a slot not handed out
asserts) but none inside one call. A slot given back twice is then handed to two transfers, and
one request reads another's KV. sglang#13483 (SGLang 0.5.5-0.5.5.post3, fixed in 0.5.6 by
PR#13501): the prefetch IO thread queued the unfilled tail of a partly served L3 prefetch for
release twice, in `HiCacheController._page_transfer` and again in `prefetch_io_aux_func`; the
scheduler's drain of that queue then freed it twice in one call.

The ledger keeps, per page, whether it is handed out, who took it, who gave it back last and who
queued it for release last (`append_host_mem_release`, the queue the scheduler drains), and names:
- `double_free`: a page given back while free, or twice in one call, or queued for release while
  already queued (the earliest sight of #13483, with both queuing sites);
- `double_alloc`: a page handed out while handed out, or twice in one call.
A page is the host pool's page (its first slot stands for it; the pool hands out and takes back
whole pages). Its state is read from the pool the first time the ledger meets it (its free list,
with 0.5.23's deferred `release_slots`), and again after each `clear()`.

Orphans (pages handed out that nobody holds) are not judged: the tree nodes' `host_value`, writes
and loads in flight and prefetches in flight hold host slots, and none of them is read here. A
pool past MAX_PAGES pages, or an index tensor on a device (reading it would synchronise), turns the
ledger off, said once in a `probe_status`. 13 bytes a page: 3.4 MB for a 16 M-token pool of
64-token pages.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvdoctor.probe.base.vocabulary import MAX_IDS_IN_EVIDENCE
from kvdoctor.trace import schema

COMPONENT = "host_slots"
MAX_PAGES = 1 << 22
FREE, HELD, QUEUED = 0, 1, 2  # a page's state bits (QUEUED: given to the release queue, not yet freed)


class NotFollowed(Exception):
    """A pool or a call this ledger cannot follow exactly."""


def host_ints(value: Any) -> np.ndarray:
    """An index tensor (or list) as int64, without a device read."""
    if value is None:
        return np.zeros(0, dtype=np.int64)
    device = getattr(value, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise NotFollowed(f"host indices on {device}: reading them would synchronise")
    if hasattr(value, "numpy"):
        return np.asarray(value.reshape(-1).numpy(), dtype=np.int64)
    return np.asarray(value, dtype=np.int64).reshape(-1)


class PoolBook:
    """One host pool's pages."""

    def __init__(self, pool: Any) -> None:
        self.name = type(pool).__name__
        self.slots = int(getattr(pool, "logical_size", None) or getattr(pool, "size", None) or 0)
        self.page_size = max(1, int(getattr(pool, "logical_page_size", None) or getattr(pool, "page_size", None) or 1))
        self.pages = -(-self.slots // self.page_size)
        if self.pages > MAX_PAGES:
            raise NotFollowed(f"{self.name} has {self.pages} pages (more than {MAX_PAGES})")
        self.state = np.zeros(self.pages, dtype=np.int8)
        self.alloc_site = np.zeros(self.pages, dtype=np.int32)
        self.free_site = np.zeros(self.pages, dtype=np.int32)
        self.queue_site = np.zeros(self.pages, dtype=np.int32)
        self.excused = np.zeros(self.pages, dtype=np.int8)  # second frees already named at a second queuing
        self.adopt(pool)

    def adopt(self, pool: Any) -> None:
        """The pool's own free list (and 0.5.23's deferred releases) as the ledger's state."""
        free = [host_ints(getattr(pool, "free_slots", None))]
        free += [host_ints(part) for part in list(getattr(pool, "release_slots", None) or [])]
        self.state.fill(HELD)
        self.alloc_site.fill(0)
        self.state[self.page_ids(np.concatenate(free), "its free list")] = FREE

    def page_ids(self, slots: np.ndarray, what: str) -> np.ndarray:
        """The pages whose first slot is in `slots` (one entry per mention)."""
        starts: np.ndarray = slots[slots % self.page_size == 0] // self.page_size
        if starts.size and (starts.min() < 0 or starts.max() >= self.pages):
            raise NotFollowed(f"{what} names slot {int(slots.max())} outside {self.name}'s {self.slots} slots")
        return starts

    def mentions(self, slots: np.ndarray, what: str, bit: int, *, set_means_bad: bool) -> tuple[np.ndarray, np.ndarray]:
        """(the distinct pages a call names, how many of its mentions of each break the rule): every
        mention past the first, and the first too where the page's `bit` is set (`set_means_bad`)
        or clear (not `set_means_bad`) before the call."""
        distinct, counts = np.unique(self.page_ids(slots, what), return_counts=True)
        flagged = (self.state[distinct] & bit) != 0
        return distinct, counts - 1 + (flagged if set_means_bad else ~flagged)


class HostSlots:
    """The books of every host pool the hooks meet (the HiCache ledger owns one)."""

    def __init__(self) -> None:
        self.books: dict[int, PoolBook] = {}
        self.lock = threading.Lock()
        self.off = ""

    def book(self, pool: Any) -> PoolBook:
        found = self.books.get(id(pool))
        if found is None:
            found = self.books[id(pool)] = PoolBook(pool)
        return found

    def guarded(self, probe: Any, work: Any, *args: Any) -> None:
        """Runs one update; anything it cannot follow turns only this ledger off, said once."""
        if self.off:
            return
        try:
            with self.lock:
                work(probe, *args)
        except Exception as exc:
            why = str(exc) if isinstance(exc, NotFollowed) else f"{type(exc).__name__}: {exc}"
            self.off = f"host pool slots not followed: {why}"
            self.books.clear()
            probe.emitter.emit(schema.PROBE_STATUS, {"component": COMPONENT, "state": "partial", "reason": self.off})

    # ----- the hooked calls -----

    def meet(self, probe: Any, pool: Any) -> None:
        """Before an alloc: a pool first met here is read while its free list still holds what the
        call hands out (met after, those slots would read as handed out already)."""
        if id(pool) not in self.books:
            self.guarded(probe, lambda _probe, p: self.book(p), pool)

    def handed_out(self, probe: Any, pool: Any, result: Any, site: int) -> None:
        if result is not None:
            self.guarded(probe, self._handed_out, pool, result, site)

    def given_back(self, probe: Any, pool: Any, indices: Any, site: int) -> None:
        self.guarded(probe, self._given_back, pool, indices, site)

    def queued(self, probe: Any, pool: Any, indices: Any, site: int) -> None:
        if pool is not None:
            self.guarded(probe, self._queued, pool, indices, site)

    def cleared(self, probe: Any, pool: Any) -> None:
        self.guarded(probe, lambda _probe, p: self.book(p).adopt(p), pool)

    def _handed_out(self, probe: Any, pool: Any, result: Any, site: int) -> None:
        book = self.book(pool)
        distinct, extra = book.mentions(host_ints(result), "an alloc", HELD, set_means_bad=True)
        if extra.any():
            self.name(probe, book, schema.DOUBLE_ALLOC, distinct[extra > 0], int(extra.sum()), site, "handed out while handed out")
        book.state[distinct] = HELD
        book.alloc_site[distinct] = site

    def _given_back(self, probe: Any, pool: Any, indices: Any, site: int) -> None:
        book = self.book(pool)
        distinct, extra = book.mentions(host_ints(indices), "a free", HELD, set_means_bad=False)
        excused = np.minimum(extra, book.excused[distinct])  # already named when they were queued twice
        book.excused[distinct] -= excused.astype(np.int8)
        extra = extra - excused
        if extra.any():
            self.name(probe, book, schema.DOUBLE_FREE, distinct[extra > 0], int(extra.sum()), site, "given back while free")
        book.state[distinct] = FREE
        book.free_site[distinct] = site

    def _queued(self, probe: Any, pool: Any, indices: Any, site: int) -> None:
        book = self.book(pool)
        distinct, extra = book.mentions(host_ints(indices), "a release", QUEUED, set_means_bad=True)
        if extra.any():
            bad = distinct[extra > 0]
            self.name(probe, book, schema.DOUBLE_FREE, bad, int(extra.sum()), site, "queued for release while already queued")
            book.excused[distinct] = np.minimum(book.excused[distinct] + extra, 64).astype(np.int8)
        book.state[distinct] |= QUEUED
        book.queue_site[distinct] = site

    def name(self, probe: Any, book: PoolBook, kind: str, pages: np.ndarray, count: int, site: int, how: str) -> None:
        ps = book.page_size
        slots = [int(s) for p in pages[: max(1, MAX_IDS_IN_EVIDENCE // ps)] for s in range(int(p) * ps, int(p) * ps + ps)]

        def tally(per_page: np.ndarray, none: str) -> dict[str, int]:
            out: dict[str, int] = {}
            for value in per_page[pages]:
                label = probe.sites.name(int(value)) if value else none
                out[label] = out.get(label, 0) + ps
            return out

        args: dict[str, Any] = {
            "kind": kind,
            "allocator": f"{book.name} (host pool)",
            "count": count * ps,
            "page_size": ps,
            "site": probe.sites.name(site),
            "sites": {probe.sites.name(site): count},  # pages, as the slot ledgers tally them
            "slot_ids": slots[:MAX_IDS_IN_EVIDENCE],
            "allocated_at": tally(book.alloc_site, "before the probe watched"),
            "why": how,
        }
        if kind == schema.DOUBLE_FREE:
            args["given_back_before_at"] = tally(book.free_site, "none seen (named twice in this call)")
            args["queued_for_release_at"] = tally(book.queue_site, "not queued")
        probe.emitter.emit(schema.VIOLATION, args)
