"""Reading a slot ledger back: violations with their evidence, counts, and the census.

On a GPU nothing here runs on the hot path: `poll()` starts an asynchronous copy and finishes it
on a later call; a census (idle, exit) is the one place that waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvdoctor.probe.base.callsites import CallSites
from kvdoctor.probe.base.vocabulary import FREE, KIND_BITS, KIND_SLOT, MAX_IDS_IN_EVIDENCE, MAX_NAMED_PAGES, OWNED, TREE
from kvdoctor.probe.ledgers.requests import BEFORE_ATTACH, ORPHANED_OWNERS, UNPROVEN, RequestTable
from kvdoctor.trace import schema

Emit = Callable[[str, dict[str, Any]], None]


def tree_unseen_reason(args: dict[str, Any]) -> str:
    host = int(args.get("tree_evictable_slots", 0)) + int(args.get("tree_protected_slots", 0))
    return (
        f"SGLang's radix tree holds {host} slots by its own count, the ledger saw it take {args.get('tree_slots', 0)}: "
        f"{args['tree_unseen_slots']} reached the tree through a path the probe does not hook, so this census names no orphan"
    )


class LedgerArrays(Protocol):
    """What the readback reads of its ledger (`slots.SlotLedger`): the arrays, their sizes, where
    events go and the lock the native path holds too."""

    name: str
    page_size: int
    num_pages: int
    rows: int
    sink: int
    xp: Any
    emit: Emit
    requests: RequestTable
    sites: CallSites
    state: Any
    owner: Any
    alloc_site: Any
    flags: Any
    violation_site: Any
    counters: Any
    oor_value: Any
    lock: Any  # native.new_lock(): reentrant, used as `with lock:`
    not_judged: str

    def fill(self, arr: Any, where: Any, value: int) -> None: ...
    def history_of(self, pages: Any) -> dict[str, Any]: ...


class SlotReadback:
    """The read side of one `SlotLedger`, which holds it: what it has reported, the read in flight."""

    def __init__(self, ledger: LedgerArrays) -> None:
        self.ledger = ledger
        self.census_count = 0
        self._reported = np.zeros(len(KIND_BITS), dtype=np.int64)
        self._pending: Any = None
        self._pending_kind = ""
        self._pending_counts: Any = None
        self.tree_unseen = ""  # why the last census could not judge: its tree took slots unseen ("" if it agreed)

    def poll(self, force: bool = False) -> None:
        """Harvests violations without blocking: starts an async read, finishes it next time."""
        with self.ledger.lock:
            if self._pending is None:
                self._pending = self.ledger.xp.snapshot([self.ledger.counters, self.ledger.oor_value])
                self._pending_kind = "counters"
            if not self._pending.ready():
                if not force:
                    return
                self._pending.wait()  # a forced read (census, exit) must not read the copy before it lands
            pending, kind = self._pending, self._pending_kind
            self._pending = None
            values = pending.get()
            if kind == "counters":
                counters, _oor = values
                if np.any(counters > self._reported):
                    self._pending = self.ledger.xp.snapshot(
                        [
                            self.ledger.counters,
                            self.ledger.oor_value,
                            self.ledger.flags,
                            self.ledger.violation_site,
                            self.ledger.owner,
                            self.ledger.alloc_site,
                            self.ledger.state,
                        ]
                    )
                    self._pending_kind = "evidence"
                    self.ledger.fill(self.ledger.flags, slice(None), 0)
                    if force or self._pending.ready():
                        self.poll(force=True)
            else:
                self._emit_violations(*values)

    def _emit_violations(
        self,
        counters: np.ndarray,
        oor_value: np.ndarray,
        flags: np.ndarray,
        vsite: np.ndarray,
        owner: np.ndarray,
        alloc_site: np.ndarray,
        state: np.ndarray,
    ) -> None:
        for kind, slot in KIND_SLOT.items():
            new = int(counters[slot] - self._reported[slot])
            if new <= 0:
                continue
            self._reported[slot] = counters[slot]
            bit = KIND_BITS[kind]
            pages = np.nonzero((flags[: self.ledger.num_pages + 1] & bit) != 0)[0]
            args: dict[str, Any] = {"kind": kind, "allocator": self.ledger.name, "count": new, "page_size": self.ledger.page_size}
            if kind == schema.INDEX_OUT_OF_RANGE:
                worst = int(oor_value[0]) if int(oor_value[0]) != 0 else int(oor_value[1])
                args.update(self._oor_args(new, worst, int(vsite[self.ledger.sink])))
            else:
                by_site: dict[str, int] = {}
                for site_id in vsite[pages][:MAX_NAMED_PAGES]:
                    name = self.ledger.sites.name(int(site_id))
                    by_site[name] = by_site.get(name, 0) + 1
                args["site"] = max(by_site, key=lambda name: by_site[name]) if by_site else "unknown"
                args["sites"] = by_site
                args.update(self._page_evidence(pages, owner, alloc_site))
            self.ledger.emit(schema.VIOLATION, args)

    def _oor_args(self, count: int, bad_index: int, site: int) -> dict[str, Any]:
        return {
            "kind": schema.INDEX_OUT_OF_RANGE,
            "allocator": self.ledger.name,
            "count": count,
            "page_size": self.ledger.page_size,
            "site": self.ledger.sites.name(site),
            "bad_index": bad_index,
            "valid_rows": [0, self.ledger.rows - 1],
            "note": "-1 is legal only as last_loc (no prefix); anything else outside the buffer faults on a GPU",
        }

    def _page_evidence(self, pages: np.ndarray, owner: Any, alloc_site: Any) -> dict[str, Any]:
        owner = self.ledger.xp.to_host(owner) if not isinstance(owner, np.ndarray) else owner
        alloc_site = self.ledger.xp.to_host(alloc_site) if not isinstance(alloc_site, np.ndarray) else alloc_site
        return {
            "slot_ids": self._slot_ids(pages),
            "requests": self._requests(owner, pages),
            "allocated_at": self._alloc_sites(alloc_site, pages),
        }

    def _slot_ids(self, pages: np.ndarray) -> list[int]:
        ps = self.ledger.page_size
        if ps == 1:
            return [int(p) for p in pages[:MAX_IDS_IN_EVIDENCE]]
        ids: list[int] = []
        for p in pages[: max(1, MAX_IDS_IN_EVIDENCE // ps)]:
            ids.extend(range(int(p) * ps, int(p) * ps + ps))
        return ids[:MAX_IDS_IN_EVIDENCE]

    def _requests(self, owner: np.ndarray, pages: np.ndarray) -> dict[str, int]:
        return self._tally(owner, pages, self.ledger.requests.describe)

    def _alloc_sites(self, alloc_site: np.ndarray, pages: np.ndarray) -> dict[str, int]:
        return self._tally(alloc_site, pages, self.ledger.sites.name)

    def _tally(self, per_page: np.ndarray, pages: np.ndarray, name_of: Callable[[int], str], weight: int = 0) -> dict[str, int]:
        """Slots per name (request, site) over the first MAX_NAMED_PAGES of `pages` (`weight` per
        entry instead of a page's slots, where the entries are not pages)."""
        out: dict[str, int] = {}
        for value in per_page[pages][:MAX_NAMED_PAGES]:
            name = name_of(int(value))
            out[name] = out.get(name, 0) + (weight or self.ledger.page_size)
        return out

    def counts(self, state: np.ndarray | None = None) -> dict[str, int]:
        st = self.ledger.xp.to_host(self.ledger.state) if state is None else state
        body = st[1 : self.ledger.num_pages + 1]
        ps = self.ledger.page_size
        return {
            "total_slots": self.ledger.num_pages * ps,
            "free_slots": int(np.count_nonzero(body & FREE)) * ps,
            "owned_slots": int(np.count_nonzero(body == OWNED)) * ps,
            "tree_slots": int(np.count_nonzero(body == TREE)) * ps,
            "tree_freed_slots": int(np.count_nonzero(body == (TREE | FREE))) * ps,
            "unaccounted_slots": int(np.count_nonzero(body == 0)) * ps,
        }

    def census(self, *, reason: str, host_free_pages: Any = None, tree_sizes: dict[str, int] | None = None) -> dict[str, Any]:
        """Counts every page (reads the ledger back: call it when the engine is idle or exiting)."""
        with self.ledger.lock:
            self.poll(force=True)
            state = self.ledger.xp.to_host(self.ledger.state)
            owner = self.ledger.xp.to_host(self.ledger.owner)
            alloc_site = self.ledger.xp.to_host(self.ledger.alloc_site)
            self.census_count += 1
            body = state[: self.ledger.num_pages + 1]
            idle = self.ledger.requests.idle
            unproven = (body == OWNED) & (owner[: self.ledger.num_pages + 1] == UNPROVEN)  # adopted, never judged
            owned = (body == OWNED) & ~unproven
            if idle:
                orphan_mask = owned | (body == 0)
            else:
                live = np.array(sorted(self.ledger.requests.live_rows()), dtype=np.int64)
                rows = owner[: self.ledger.num_pages + 1]
                dead_owner = ((rows >= 0) & ~np.isin(rows, live)) | np.isin(rows, ORPHANED_OWNERS)
                orphan_mask = (owned & dead_owner) | (body == 0)
            orphan_mask[0] = False
            orphan_pages = np.nonzero(orphan_mask)[0]
            dangling = np.nonzero(body == (TREE | FREE))[0]
            args: dict[str, Any] = {
                "allocator": self.ledger.name,
                "reason": reason,
                "idle": idle,
                "page_size": self.ledger.page_size,
                "live_requests": len(self.ledger.requests.live_rows()),
                **self.counts(state),
                "orphan_slots": int(orphan_pages.size) * self.ledger.page_size,
                "unproven_slots": int(np.count_nonzero(unproven)) * self.ledger.page_size,
                "orphan_slot_ids": self._slot_ids(orphan_pages),
                "orphan_allocated_at": self._alloc_sites(alloc_site, orphan_pages),
                "orphan_requests": self._requests(owner, orphan_pages),
                "tree_holds_free_slot_ids": self._slot_ids(dangling),
            }
            if tree_sizes:
                args.update(tree_sizes)
                if not self._reported.any():  # after a double free or alloc the books differ for a reason already named
                    args.update(self._compare_tree_with_host(args, tree_sizes))
                self.tree_unseen = tree_unseen_reason(args) if args.get("tree_unseen_slots") else ""
            if host_free_pages is not None:
                args.update(self._compare_with_host(body, host_free_pages))
            args.update(self.before_attach(orphan_pages, owner))
            args.update(self.ledger.history_of(orphan_pages) if orphan_pages.size else {})  # their flight recorder
            if self.ledger.not_judged:
                args.update(judged=False, not_judged=self.ledger.not_judged)
            elif tree_sizes and self.tree_unseen:
                args.update(judged=False, not_judged=self.tree_unseen)
            self.ledger.emit(schema.CENSUS, args)
            return args

    def before_attach(self, orphan_pages: np.ndarray, owner: np.ndarray) -> dict[str, Any]:
        """Of the orphans, those an adoption found held by no one (leaked before the probe came)."""
        early = orphan_pages[owner[orphan_pages] == BEFORE_ATTACH]
        if not early.size:
            return {}
        return {
            "orphan_before_attach_slots": int(early.size) * self.ledger.page_size,
            "orphan_before_attach_slot_ids": self._slot_ids(early),
        }

    @staticmethod
    def _compare_tree_with_host(args: dict[str, Any], tree_sizes: dict[str, int]) -> dict[str, Any]:
        """SGLang's own count of what its tree holds against the ledger's: a tree holding more than
        the ledger gave it took slots through a path the probe does not see (0.5.23's HiCache load
        back, for one), and the ledger would name those as leaked."""
        evictable, protected = tree_sizes.get("tree_evictable_slots"), tree_sizes.get("tree_protected_slots")
        if not isinstance(evictable, int) or not isinstance(protected, int):
            return {}
        unseen = evictable + protected - int(args.get("tree_slots", 0))
        return {"tree_unseen_slots": unseen} if unseen > 0 else {}

    def _compare_with_host(self, body: np.ndarray, host_free_pages: Any) -> dict[str, Any]:
        """The allocator's own free list against the ledger: a disagreement the ledger cannot
        explain means a path we do not hook changed slots, and the ledger cannot be trusted."""
        host = np.unique(np.asarray(host_free_pages, dtype=np.int64))
        host = host[(host >= 0) & (host <= self.ledger.num_pages)]
        ledger_free = np.nonzero((body & FREE) != 0)[0]
        only_host = np.setdiff1d(host, ledger_free, assume_unique=True)
        only_ledger = np.setdiff1d(ledger_free, host, assume_unique=True)
        return {
            "host_free_slots": int(host.size) * self.ledger.page_size,
            "ledger_disagrees_slots": int(only_host.size + only_ledger.size) * self.ledger.page_size,
            "free_only_in_host_slot_ids": self._slot_ids(only_host),
            "free_only_in_ledger_slot_ids": self._slot_ids(only_ledger),
        }

    def counter_args(self) -> dict[str, Any]:
        return {"allocator": self.ledger.name, **self.counts()}

    def counter_args_async(self) -> dict[str, Any] | None:
        """Ledger sizes for a device ledger without a sync: starts a read, returns the previous one."""
        ready = None
        pending = self._pending_counts
        if pending is not None and pending.ready():
            state = pending.get()[0]
            ready = {"allocator": self.ledger.name, **self.counts(state)}
            pending = None
        if pending is None:
            self._pending_counts = self.ledger.xp.snapshot([self.ledger.state])
        else:
            self._pending_counts = pending
        return ready
