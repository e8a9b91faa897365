"""The KV slot ledger: the state of every page of one allocator, kept beside the host's own lists.

Each page carries a state byte (FREE / OWNED by a request / held by the TREE), the request row
that owns it, the call site that allocated it, and violation bits. Every hooked call updates it
with a few vectorised gathers and scatters on the device the indices live on. Rules broken at a
call set violation bits and counters; `poll()` reads those asynchronously and emits events with
the slot ids, call site and request as evidence. A census (at idle and at exit) counts every
page and names the orphans: pages neither free, nor in the tree, nor owned by a live request.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import numpy as np

from kvdoctor.trace import schema
from kvdoctor.probe.ledger.arrays import arrays_for

FREE = 1
OWNED = 2
TREE = 4
RESERVED = 8

# Violation bits (per page) and counter slots, one per kind.
KIND_BITS = {
    schema.DOUBLE_FREE: 1,
    schema.DOUBLE_ALLOC: 2,
    schema.STALE_LAST_LOC: 4,
    schema.INDEX_OUT_OF_RANGE: 8,
    schema.USE_AFTER_FREE: 16,
}
KIND_SLOT = {kind: i for i, kind in enumerate(KIND_BITS)}
MAX_IDS_IN_EVIDENCE = 64

Emit = Callable[[str, dict[str, Any]], None]


class RequestTable:
    """Which request rows (req_pool_idx) are live, and the request id each one serves."""

    def __init__(self) -> None:
        self.live: dict[int, str] = {}
        self.finished: dict[int, str] = {}
        self.ever_allocated = 0

    def allocated(self, index: int, rid: str) -> None:
        self.live[index] = rid
        self.finished.pop(index, None)
        self.ever_allocated += 1

    def freed(self, index: int) -> None:
        rid = self.live.pop(index, None)
        if rid is not None:
            self.finished[index] = rid
            if len(self.finished) > 4096:  # bounded: forget the oldest finished rows
                self.finished.pop(next(iter(self.finished)))

    def cleared(self) -> None:
        for index in list(self.live):
            self.freed(index)

    def describe(self, index: int) -> str:
        if index < 0:
            return "unknown request"
        if index in self.live:
            return f"req_pool_idx {index} (rid {self.live[index]}, live)"
        if index in self.finished:
            return f"req_pool_idx {index} (rid {self.finished[index]}, finished)"
        return f"req_pool_idx {index}"

    @property
    def idle(self) -> bool:
        return not self.live


class CallSites:
    """Interns call sites (a few frames above the hooked call) as small integers."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}
        self.names: list[str] = ["unknown"]
        self._lock = threading.Lock()

    def intern(self, key: tuple, describe: Callable[[], str]) -> int:
        found = self._ids.get(key)
        if found is not None:
            return found
        with self._lock:
            if key not in self._ids:
                if len(self.names) >= 65535:  # bounded
                    return 0
                self._ids[key] = len(self.names)
                self.names.append(describe())
            return self._ids[key]

    def name(self, site_id: int) -> str:
        return self.names[site_id] if 0 <= site_id < len(self.names) else "unknown"


class SlotLedger:
    """The ledger of one token-to-KV allocator, in pages (a page is one slot when page_size is 1)."""

    def __init__(
        self,
        *,
        name: str,
        size: int,
        page_size: int,
        device: Any,
        emit: Emit,
        requests: RequestTable,
        sites: CallSites,
        xp: Any = None,
    ) -> None:
        """`xp` overrides where the ledger lives (arrays_for(device) by default): a torch ledger on
        CPU tensors exercises the GPU path without a GPU."""
        self.name = name
        self.size = int(size)
        self.page_size = max(1, int(page_size))
        self.num_pages = self.size // self.page_size
        # SGLang's KV buffer has size + page_size rows: row 0 (page 0) is the padding slot.
        self.rows = self.size + self.page_size
        self.sink = self.num_pages + 1  # where out-of-range indices are parked, never counted
        self.xp = xp if xp is not None else arrays_for(device)
        self.emit = emit
        self.requests = requests
        self.sites = sites
        n = self.num_pages + 2
        self.state = self.xp.zeros(n, "int8")
        self.owner = self.xp.full(n, -1, "int32")
        self.alloc_site = self.xp.zeros(n, "int32")
        self.flags = self.xp.zeros(n, "int32")
        self.violation_site = self.xp.zeros(n, "int32")
        self.counters = self.xp.zeros(len(KIND_BITS), "int64")
        self.oor_value = self.xp.zeros(2, "int64")  # worst index past the end, worst below -1
        self.kernels: Any = None
        if not self.xp.sync_free_branching and (str(device).startswith("cuda") or os.environ.get("KVDOCTOR_LEDGER_KERNELS")):
            self.use_kernels()
        self._reported = np.zeros(len(KIND_BITS), dtype=np.int64)
        self._pending: Any = None
        self._pending_kind = ""
        self.calls = 0
        self.census_count = 0
        self.lock = threading.RLock()
        self.reset_all_free()

    def use_kernels(self) -> bool:
        """Two Triton kernels per call instead of ~40 torch ops (GPU ledgers); False if unavailable."""
        try:
            from kvdoctor.probe.ledger.kernels import LedgerKernels
        except Exception:
            return False
        self.kernels = LedgerKernels(self, KIND_SLOT, KIND_BITS)
        return True

    # ----- state changes, one per hooked role -----

    def _fill(self, arr: Any, pages: Any, value: int) -> None:
        """arr[pages] = value. On a device, index_fill_ passes the value as a kernel argument: an indexed
        assignment of a Python scalar first copies it from pageable host memory, a synchronisation."""
        if self.xp.sync_free_branching:
            arr[pages] = value
        else:
            arr.index_fill_(0, pages, value)

    def _set(self, arr: Any, where: Any, value: int) -> None:
        """arr[where] = value for an int or a slice; on a device through fill_ (no host-to-device copy)."""
        if self.xp.sync_free_branching:
            arr[where] = value
        elif isinstance(where, slice):
            arr[where].fill_(value)
        else:
            arr[where : where + 1].fill_(value)

    def reset_all_free(self) -> None:
        """The allocator's `clear()`: every page but the padding page is free again."""
        self._set(self.state, slice(None), FREE)
        self._set(self.state, 0, RESERVED)
        self._set(self.state, self.sink, RESERVED)
        self._set(self.owner, slice(None), -1)

    def _pages(self, idx: Any, site: int, *, allow_minus_one: bool = False, as_pages: bool = False) -> Any:
        """Slot indices (or page ids, `as_pages`) to page ids; out-of-range entries are counted, in
        slots, and parked on the sink page. -1 is legal only where `allow_minus_one` (last_loc)."""
        xp = self.xp
        if as_pages:
            bad = (idx < 1) | (idx > self.num_pages)
            pages = idx
        else:
            bad = (idx < 0) | (idx >= self.rows)
            if allow_minus_one:
                bad = bad & (idx != -1)
            pages = idx // self.page_size
        weight = self.page_size if as_pages else 1
        n_bad = bad.sum()
        if xp.sync_free_branching and not n_bad:
            return xp.where(idx < 0, self.sink, pages) if allow_minus_one else pages
        slot = KIND_SLOT[schema.INDEX_OUT_OF_RANGE]
        self.counters[slot] += n_bad * weight
        if xp.sync_free_branching:
            values = idx[bad]
            self._reported[slot] += n_bad * weight
            self.emit(schema.VIOLATION, self._oor_args(int(n_bad) * weight, int(values[np.abs(values).argmax()]), site))
        else:
            worst = xp.where(bad, idx, 0)
            if worst.shape[0] > 0:
                pick = worst[abs(worst).argmax().reshape(1)]  # a 1-element index: no value read back
                self.oor_value[0:1] = xp.where(n_bad > 0, pick, self.oor_value[0:1])
            self.flags[self.sink : self.sink + 1] |= xp.cast(xp.where(n_bad > 0, KIND_BITS[schema.INDEX_OUT_OF_RANGE], 0), self.flags)
            self.violation_site[self.sink] = xp.where(n_bad > 0, site, self.violation_site[self.sink])
        return xp.where(bad | (idx < 0), self.sink, pages)

    def _flag(self, pages: Any, mask: Any, kind: str, site: int, weight: int = 1) -> None:
        """Records a broken rule at `pages` where `mask`; `weight` slots per masked entry."""
        xp = self.xp
        count = mask.sum() * weight
        if xp.sync_free_branching:
            if count:  # on the host, evidence is exact and free: report this very call
                slot = KIND_SLOT[kind]
                self.counters[slot] += count
                self._reported[slot] += count
                bad = np.unique(pages[mask])
                args = {"kind": kind, "allocator": self.name, "count": int(count), "page_size": self.page_size,
                        "site": self.sites.name(site), "sites": {self.sites.name(site): int(bad.size)}}
                args.update(self._page_evidence(bad, self.owner, self.alloc_site))
                self.emit(schema.VIOLATION, args)
            return
        self.counters[KIND_SLOT[kind]] += count
        bit = KIND_BITS[kind]
        self.flags[pages] = xp.cast(self.flags[pages] | xp.where(mask, bit, 0), self.flags)
        self.violation_site[pages] = xp.cast(xp.where(mask, site, self.violation_site[pages]), self.violation_site)

    def on_alloc(self, slots_tensor: Any, site: int, *, only_page_starts: bool) -> None:
        """Slots handed out. With `only_page_starts`, slots inside a page the request already
        holds (paged extend/decode continuing its last page) are not new pages."""
        xp = self.xp
        slots = xp.index(slots_tensor)
        if self.kernels is not None:
            return self.kernels.alloc(slots, site, only_page_starts and self.page_size > 1)
        if xp.sync_free_branching and slots.shape[0] == 1 and self._alloc_one(int(slots[0]), site, only_page_starts):
            return
        pages = self._pages(slots, site)
        if only_page_starts and self.page_size > 1:
            pages = xp.where(slots % self.page_size == 0, pages, self.sink)
        before = self.state[pages]
        taken = (before != FREE) & (pages != self.sink)
        self._flag(pages, taken, schema.DOUBLE_ALLOC, site)
        self._fill(self.state, pages, OWNED)
        self._fill(self.owner, pages, -1)
        self._fill(self.alloc_site, pages, site)
        self._set(self.state, self.sink, RESERVED)

    def _alloc_one(self, slot: int, site: int, only_page_starts: bool) -> bool:
        """Scalar fast path for the commonest call (one decode slot); False sends it to the general path."""
        if not 0 <= slot < self.rows:
            return False
        page, offset = divmod(slot, self.page_size)
        if only_page_starts and offset:
            return True
        if self.state[page] != FREE:
            return False
        self.state[page] = OWNED
        self.owner[page] = -1
        self.alloc_site[page] = site
        return True

    def _free_one(self, slot: int, evicting: bool) -> bool:
        if not 0 <= slot < self.rows:
            return False
        page = slot // self.page_size
        state = int(self.state[page])
        if state & FREE or state == RESERVED:
            return False
        self.state[page] = FREE if evicting else (state & TREE) | FREE
        return True

    def on_free(self, slots_tensor: Any, site: int, *, evicting: bool, as_pages: bool = False) -> None:
        """Slots returned to the allocator. Outside a tree eviction the tree bit survives: a tree
        still pointing at a freed page is how a later double allocation starts."""
        xp = self.xp
        idx = xp.index(slots_tensor)
        if self.kernels is not None:
            return self.kernels.free(idx, site, evicting, as_pages)
        if xp.sync_free_branching and not as_pages and idx.shape[0] == 1 and self._free_one(int(idx[0]), evicting):
            return
        pages = self._pages(idx, site, as_pages=as_pages)
        weight = self.page_size if as_pages else 1
        before = self.state[pages]
        already = ((before & FREE) != 0) & (pages != self.sink)
        self._flag(pages, already, schema.DOUBLE_FREE, site, weight)
        if evicting:
            self._fill(self.state, pages, FREE)
        else:
            self.state[pages] = xp.cast((before & TREE) | FREE, self.state)
        self._set(self.state, self.sink, RESERVED)

    def on_tree_insert(self, slots_tensor: Any, site: int) -> None:
        """Slots the tree took over from a request (the part of the key it did not hold yet)."""
        xp = self.xp
        slots = xp.index(slots_tensor)
        if self.kernels is not None:
            return self.kernels.tree_insert(slots, site)
        pages = self._pages(slots, site)
        before = self.state[pages]
        freed = ((before & FREE) != 0) & (pages != self.sink)
        self._flag(pages, freed, schema.USE_AFTER_FREE, site)
        self._fill(self.state, pages, TREE)
        self._fill(self.owner, pages, -1)
        self._set(self.state, self.sink, RESERVED)

    def on_tree_reset(self) -> None:
        self.state[:] = self.xp.cast(self.state & ~TREE, self.state)

    def on_owner(self, slots_tensor: Any, req_index: Any) -> None:
        """A request row now points at these slots (req_to_token writes): they belong to it."""
        xp = self.xp
        slots = xp.index(slots_tensor)
        if self.kernels is not None:
            if not isinstance(req_index, int):
                req_index = xp.index(req_index)
                if req_index.shape != slots.shape:
                    return
            return self.kernels.owner(slots, req_index)
        if xp.sync_free_branching and slots.shape[0] == 1 and isinstance(req_index, int):
            slot = int(slots[0])
            if 0 <= slot < self.rows:
                page = slot // self.page_size
                if self.state[page] == OWNED:
                    self.owner[page] = req_index
                return
        bad = (slots < 0) | (slots >= self.rows)
        pages = xp.where(bad, self.sink, slots // self.page_size)
        owned = self.state[pages] == OWNED
        if isinstance(req_index, int):
            req = req_index
        else:
            req = xp.index(req_index)
            if req.shape != pages.shape:
                return
        self.owner[pages] = xp.cast(xp.where(owned, req, self.owner[pages]), self.owner)

    def check_last_loc(self, last_loc_tensor: Any, site: int, req_indices: Any = None) -> None:
        """`last_loc` (the slot before the new tokens, -1 for none) must point into a page the
        request still holds: not free, and owned by that request when we know which it is."""
        xp = self.xp
        last = xp.index(last_loc_tensor)
        if self.kernels is not None:
            req = xp.index(req_indices) if req_indices is not None else None
            return self.kernels.last_loc(last, site, req if req is not None and req.shape == last.shape else None)
        if xp.sync_free_branching and last.shape[0] == 1:
            value = int(last[0])
            if value == -1:
                return
            if 0 <= value < self.rows:
                page = value // self.page_size
                state = int(self.state[page])
                owner = int(self.owner[page])
                req = int(xp.index(req_indices)[0]) if req_indices is not None else -1
                if not (state & FREE) and state & (OWNED | TREE) and not (state == OWNED and owner >= 0 and req >= 0 and owner != req):
                    return  # the common, healthy case; anything else takes the general path
        pages = self._pages(last, site, allow_minus_one=True)
        st = self.state[pages]
        valid = (last >= 0) & (pages != self.sink)
        stale = valid & (((st & FREE) != 0) | ((st & (OWNED | TREE)) == 0))
        if req_indices is not None:
            req = xp.index(req_indices)
            if req.shape == pages.shape:
                own = self.owner[pages]
                stale = stale | (valid & (st == OWNED) & (own >= 0) & (own != req))
        self._flag(pages, stale, schema.STALE_LAST_LOC, site)

    # ----- reading back -----

    def poll(self, force: bool = False) -> None:
        """Harvests violations without blocking: starts an async read, finishes it next time."""
        with self.lock:
            if self._pending is None:
                self._pending = self.xp.snapshot([self.counters, self.oor_value])
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
                    self._pending = self.xp.snapshot(
                        [self.counters, self.oor_value, self.flags, self.violation_site, self.owner, self.alloc_site, self.state]
                    )
                    self._pending_kind = "evidence"
                    self._set(self.flags, slice(None), 0)
                    if force or self._pending.ready():
                        self.poll(force=True)
            else:
                self._emit_violations(*values)

    def _emit_violations(self, counters, oor_value, flags, vsite, owner, alloc_site, state) -> None:
        for kind, slot in KIND_SLOT.items():
            new = int(counters[slot] - self._reported[slot])
            if new <= 0:
                continue
            self._reported[slot] = counters[slot]
            bit = KIND_BITS[kind]
            pages = np.nonzero((flags[: self.num_pages + 1] & bit) != 0)[0]
            args: dict[str, Any] = {"kind": kind, "allocator": self.name, "count": new, "page_size": self.page_size}
            if kind == schema.INDEX_OUT_OF_RANGE:
                worst = int(oor_value[0]) if int(oor_value[0]) != 0 else int(oor_value[1])
                args.update(self._oor_args(new, worst, int(vsite[self.sink])))
            else:
                by_site: dict[str, int] = {}
                for site_id in vsite[pages][:4096]:
                    name = self.sites.name(int(site_id))
                    by_site[name] = by_site.get(name, 0) + 1
                args["site"] = max(by_site, key=by_site.get) if by_site else "unknown"
                args["sites"] = by_site
                args.update(self._page_evidence(pages, owner, alloc_site))
            self.emit(schema.VIOLATION, args)

    def _oor_args(self, count: int, bad_index: int, site: int) -> dict[str, Any]:
        return {"kind": schema.INDEX_OUT_OF_RANGE, "allocator": self.name, "count": count, "page_size": self.page_size,
                "site": self.sites.name(site), "bad_index": bad_index, "valid_rows": [0, self.rows - 1],
                "note": "-1 is legal only as last_loc (no prefix); anything else outside the buffer faults on a GPU"}

    def _page_evidence(self, pages: np.ndarray, owner: Any, alloc_site: Any) -> dict[str, Any]:
        owner = self.xp.to_host(owner) if not isinstance(owner, np.ndarray) else owner
        alloc_site = self.xp.to_host(alloc_site) if not isinstance(alloc_site, np.ndarray) else alloc_site
        return {"slot_ids": self._slot_ids(pages), "requests": self._requests(owner, pages),
                "allocated_at": self._alloc_sites(alloc_site, pages)}

    def _slot_ids(self, pages: np.ndarray) -> list[int]:
        ps = self.page_size
        if ps == 1:
            return [int(p) for p in pages[:MAX_IDS_IN_EVIDENCE]]
        ids: list[int] = []
        for p in pages[: max(1, MAX_IDS_IN_EVIDENCE // ps)]:
            ids.extend(range(int(p) * ps, int(p) * ps + ps))
        return ids[:MAX_IDS_IN_EVIDENCE]

    def _requests(self, owner: np.ndarray, pages: np.ndarray) -> dict[str, int]:
        out: dict[str, int] = {}
        for req in owner[pages][:4096]:
            name = self.requests.describe(int(req))
            out[name] = out.get(name, 0) + self.page_size
        return out

    def _alloc_sites(self, alloc_site: np.ndarray, pages: np.ndarray) -> dict[str, int]:
        out: dict[str, int] = {}
        for site_id in alloc_site[pages][:4096]:
            name = self.sites.name(int(site_id))
            out[name] = out.get(name, 0) + self.page_size
        return out

    def counts(self, state: np.ndarray | None = None) -> dict[str, int]:
        st = self.xp.to_host(self.state) if state is None else state
        body = st[1 : self.num_pages + 1]
        ps = self.page_size
        return {
            "total_slots": self.num_pages * ps,
            "free_slots": int(np.count_nonzero(body & FREE)) * ps,
            "owned_slots": int(np.count_nonzero(body == OWNED)) * ps,
            "tree_slots": int(np.count_nonzero(body == TREE)) * ps,
            "tree_freed_slots": int(np.count_nonzero(body == (TREE | FREE))) * ps,
            "unaccounted_slots": int(np.count_nonzero(body == 0)) * ps,
        }

    def census(self, *, reason: str, host_free_pages: Any = None, tree_sizes: dict[str, int] | None = None) -> dict[str, Any]:
        """Counts every page (reads the ledger back: call it when the engine is idle or exiting)."""
        with self.lock:
            self.poll(force=True)
            state = self.xp.to_host(self.state)
            owner = self.xp.to_host(self.owner)
            alloc_site = self.xp.to_host(self.alloc_site)
            self.census_count += 1
            body = state[: self.num_pages + 1]
            idle = self.requests.idle
            owned = body == OWNED
            if idle:
                orphan_mask = owned | (body == 0)
            else:
                live = np.array(sorted(self.requests.live), dtype=np.int64)
                dead_owner = (owner[: self.num_pages + 1] >= 0) & ~np.isin(owner[: self.num_pages + 1], live)
                orphan_mask = (owned & dead_owner) | (body == 0)
            orphan_mask[0] = False
            orphan_pages = np.nonzero(orphan_mask)[0]
            dangling = np.nonzero(body == (TREE | FREE))[0]
            args: dict[str, Any] = {
                "allocator": self.name,
                "reason": reason,
                "idle": idle,
                "page_size": self.page_size,
                "live_requests": len(self.requests.live),
                **self.counts(state),
                "orphan_slots": int(orphan_pages.size) * self.page_size,
                "orphan_slot_ids": self._slot_ids(orphan_pages),
                "orphan_allocated_at": self._alloc_sites(alloc_site, orphan_pages),
                "orphan_requests": self._requests(owner, orphan_pages),
                "tree_holds_free_slot_ids": self._slot_ids(dangling),
            }
            if tree_sizes:
                args.update(tree_sizes)
            if host_free_pages is not None:
                args.update(self._compare_with_host(body, host_free_pages))
            self.emit(schema.CENSUS, args)
            return args

    def _compare_with_host(self, body: np.ndarray, host_free_pages: Any) -> dict[str, Any]:
        """The allocator's own free list against the ledger: a disagreement the ledger cannot
        explain means a path we do not hook changed slots, and the ledger cannot be trusted."""
        host = np.unique(np.asarray(host_free_pages, dtype=np.int64))
        host = host[(host >= 0) & (host <= self.num_pages)]
        ledger_free = np.nonzero((body & FREE) != 0)[0]
        only_host = np.setdiff1d(host, ledger_free, assume_unique=True)
        only_ledger = np.setdiff1d(ledger_free, host, assume_unique=True)
        return {
            "host_free_slots": int(host.size) * self.page_size,
            "ledger_disagrees_slots": int(only_host.size + only_ledger.size) * self.page_size,
            "free_only_in_host_slot_ids": self._slot_ids(only_host),
            "free_only_in_ledger_slot_ids": self._slot_ids(only_ledger),
        }

    def counter_args(self) -> dict[str, Any]:
        return {"allocator": self.name, **self.counts()}

    def counter_args_async(self) -> dict[str, Any] | None:
        """Ledger sizes for a device ledger without a sync: starts a read, returns the previous one."""
        ready = None
        pending = getattr(self, "_pending_counts", None)
        if pending is not None and pending.ready():
            state = pending.get()[0]
            ready = {"allocator": self.name, **self.counts(state)}
            pending = None
        if pending is None:
            self._pending_counts = self.xp.snapshot([self.state])
        else:
            self._pending_counts = pending
        return ready
