"""The KV slot ledger: the state of every page of one allocator, kept beside the host's own lists.

Each page carries a state byte (FREE / OWNED by a request / held by the TREE), the request row
that owns it, the call site that allocated it, and violation bits. Every hooked call updates it
with a few vectorised gathers and scatters on the device the indices live on. Rules broken at a
call set violation bits and counters; `poll()` reads those asynchronously and emits events with
the slot ids, call site and request as evidence. A census (at idle and at exit) counts every page
and names the orphans: pages neither free, nor in the tree, nor owned by a live request. A host
ledger keeps each page's last transitions too (history.py: 161 bytes a page at N = 8).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvdoctor.probe import native
from kvdoctor.probe.base.callsites import CallSites
from kvdoctor.probe.base.settings import env_switch
from kvdoctor.probe.base.vocabulary import FREE, KIND_BITS, KIND_SLOT, OWNED, RESERVED, TREE
from kvdoctor.probe.ledgers import crash_box
from kvdoctor.probe.ledgers import history as rec
from kvdoctor.probe.ledgers.arrays import arrays_for
from kvdoctor.probe.ledgers.requests import RequestTable
from kvdoctor.probe.ledgers.slot_census import Emit, SlotReadback
from kvdoctor.trace import schema


class SlotLedger:
    """The ledger of one token-to-KV allocator, in pages (a page is one slot when page_size is 1)."""

    def __init__(
        self, *, name: str, size: int, page_size: int, device: Any, emit: Emit, requests: RequestTable, sites: CallSites, xp: Any = None
    ) -> None:
        """`xp` overrides where the ledger lives (arrays_for(device) by default): a torch ledger on
        CPU tensors exercises the GPU path without a GPU."""
        self.name = name
        # Whether its orphan verdicts stand: only where the probe proved it sees every holder of the
        # pool's slots (set by the engine's state; a ledger not judged still counts, and says why not).
        self.not_judged = ""
        self.size = int(size)
        self.page_size = max(1, int(page_size))
        self.num_pages = self.size // self.page_size
        # SGLang's KV buffer has size + page_size rows: row 0 (page 0) is the padding slot.
        self.rows = self.size + self.page_size
        self.sink = self.num_pages + 1  # where out-of-range indices are parked, never counted
        self.xp: Any = xp if xp is not None else arrays_for(device)
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
        if not self.xp.sync_free_branching and (str(device).startswith("cuda") or env_switch("KVDOCTOR_LEDGER_KERNELS", False)):
            self.use_kernels()
        crash_box.adopt(self, n, device)  # under kvdoctor run: counters a crash cannot take (crash_box.py)
        self.history, self.history_off = rec.for_ledger(n, self.xp, self.kernels)  # the flight recorder: host ledgers only
        self.calls, self.lock = 0, native.new_lock()
        self.readback = SlotReadback(self)  # violations, counts and the census, read back from these arrays
        self.reset_all_free()

    def use_kernels(self) -> bool:
        """Two Triton kernels per call instead of ~40 torch ops (GPU ledgers); False if unavailable."""
        try:
            from kvdoctor.probe.ledgers.kernels import LedgerKernels
        except Exception:
            return False
        self.kernels = LedgerKernels(self)
        return True

    def fill(self, arr: Any, where: Any, value: int) -> None:
        """arr[where] = value for an int or a slice; on a device through fill_ (no host-to-device copy)."""
        if self.xp.sync_free_branching:
            arr[where] = value
        elif isinstance(where, slice):
            arr[where].fill_(value)
        else:
            arr[where : where + 1].fill_(value)

    # ----- the read side (`slot_census.SlotReadback`) -----

    def poll(self, force: bool = False) -> None:
        self.readback.poll(force)

    def counts(self, state: np.ndarray | None = None) -> dict[str, int]:
        return self.readback.counts(state)

    def census(self, *, reason: str, host_free_pages: Any = None, tree_sizes: dict[str, int] | None = None) -> dict[str, Any]:
        return self.readback.census(reason=reason, host_free_pages=host_free_pages, tree_sizes=tree_sizes)

    def counter_args(self) -> dict[str, Any]:
        return self.readback.counter_args()

    def counter_args_async(self) -> dict[str, Any] | None:
        return self.readback.counter_args_async()

    def history_of(self, pages: Any) -> dict[str, Any]:  # a census's orphans' evidence (off the hot path)
        return rec.evidence(self, pages, census=True)

    def _record(self, pages: Any, op: int, site: int, rows: Any = -1, *, unique: bool = False) -> None:
        rec.record_pages(self.history, self.num_pages, pages, op, site, rows, unique)  # type: ignore[arg-type]

    # ----- state changes, one per hooked role -----

    def _fill(self, arr: Any, pages: Any, value: int) -> None:
        """arr[pages] = value. On a device, index_fill_ passes the value as a kernel argument: an indexed
        assignment of a Python scalar first copies it from pageable host memory, a synchronisation."""
        if self.xp.sync_free_branching:
            arr[pages] = value
        else:
            arr.index_fill_(0, pages, value)

    def reset_all_free(self) -> None:
        """The allocator's `clear()`: every page but the padding page is free again."""
        self.fill(self.state, slice(None), FREE)
        self.fill(self.state, 0, RESERVED)
        self.fill(self.state, self.sink, RESERVED)
        self.fill(self.owner, slice(None), -1)

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
            self.readback._reported[slot] += n_bad * weight
            self.emit(schema.VIOLATION, self.readback._oor_args(int(n_bad) * weight, int(values[np.abs(values).argmax()]), site))
        else:
            worst = xp.where(bad, idx, 0)
            if worst.shape[0] > 0:
                pick = worst[abs(worst).argmax().reshape(1)]  # a 1-element index: no value read back
                self.oor_value[0:1] = xp.where(n_bad > 0, pick, self.oor_value[0:1])
            self.flags[self.sink : self.sink + 1] |= xp.cast(xp.where(n_bad > 0, KIND_BITS[schema.INDEX_OUT_OF_RANGE], 0), self.flags)
            self.violation_site[self.sink] = xp.where(n_bad > 0, site, self.violation_site[self.sink])
        return xp.where(bad | (idx < 0), self.sink, pages)

    def _flag(self, pages: Any, mask: Any, kind: str, site: int, weight: int = 1, extra: dict[str, Any] | None = None) -> None:
        """Records a broken rule at `pages` where `mask`; `weight` slots per masked entry; `extra`
        evidence goes into the event where it is emitted at once (on the host)."""
        xp = self.xp
        count = mask.sum() * weight
        if xp.sync_free_branching:
            if count:  # on the host, evidence is exact and free: report this very call
                slot = KIND_SLOT[kind]
                self.counters[slot] += count
                self.readback._reported[slot] += count
                bad = np.unique(pages[mask])
                args = {
                    "kind": kind,
                    "allocator": self.name,
                    "count": int(count),
                    "page_size": self.page_size,
                    "site": self.sites.name(site),
                    "sites": {self.sites.name(site): int(bad.size)},
                }
                args.update(self.readback._page_evidence(bad, self.owner, self.alloc_site))
                args.update(rec.evidence(self, bad))
                args.update(extra or {})
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
        if xp.sync_free_branching and self.kernels is None:
            one = xp.single(slots_tensor)
            if one is not None and self._alloc_one(one, site, only_page_starts):
                return
        if self.kernels is not None:
            self.kernels.alloc(self.kernels.index(slots_tensor), site, only_page_starts and self.page_size > 1)
            return
        slots = xp.index(slots_tensor)
        pages = self._pages(slots, site)
        if only_page_starts and self.page_size > 1:
            pages = xp.where(slots % self.page_size == 0, pages, self.sink)
        before = self.state[pages]
        taken = (before != FREE) & (pages != self.sink)
        if self.page_size == 1 or only_page_starts:  # each entry a page of its own: one named twice is taken twice
            taken = xp.or_repeated(taken, pages, self.sink)
        if self.history is not None:
            self._record(pages, rec.OP_ALLOC, site)
        self._flag(pages, taken, schema.DOUBLE_ALLOC, site)
        self._fill(self.state, pages, OWNED)
        self._fill(self.owner, pages, -1)
        self._fill(self.alloc_site, pages, site)
        self.fill(self.state, self.sink, RESERVED)

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
        if self.history is not None and page:
            self.history.one(page, rec.OP_ALLOC, site, -1)
        return True

    def _free_one(self, slot: int, evicting: bool, site: int) -> bool:
        if not 0 <= slot < self.rows:
            return False
        page = slot // self.page_size
        state = int(self.state[page])
        if state & FREE or state == RESERVED:
            return False
        self.state[page] = FREE if evicting else (state & TREE) | FREE
        if self.history is not None:
            self.history.one(page, rec.OP_EVICT if evicting else rec.OP_FREE, site, int(self.owner[page]))
        return True

    def on_free(self, slots_tensor: Any, site: int, *, evicting: bool, as_pages: bool = False) -> None:
        """Slots returned to the allocator. Outside a tree eviction the tree bit survives: a tree
        still pointing at a freed page is how a later double allocation starts."""
        xp = self.xp
        if xp.sync_free_branching and self.kernels is None and not as_pages:
            one = xp.single(slots_tensor)
            if one is not None and self._free_one(one, evicting, site):
                return
        if self.kernels is not None:
            self.kernels.free(self.kernels.index(slots_tensor), site, evicting, as_pages)
            return
        idx = xp.index(slots_tensor)
        pages = self._pages(idx, site, as_pages=as_pages)
        weight = self.page_size if as_pages else 1
        before = self.state[pages]
        already = ((before & FREE) != 0) & (pages != self.sink)
        if self.page_size == 1 or as_pages:  # SGLang's paged free keeps each page once; a one-slot page's does not
            already = xp.or_repeated(already, pages, self.sink)
        if self.history is not None:
            self._record(pages, rec.OP_EVICT if evicting else rec.OP_FREE, site, self.owner[pages])
        self._flag(pages, already, schema.DOUBLE_FREE, site, weight)
        if evicting:
            self._fill(self.state, pages, FREE)
        else:
            self.state[pages] = xp.cast((before & TREE) | FREE, self.state)
        self.fill(self.state, self.sink, RESERVED)

    def on_restore(self, restored: Any, current: Any, site: int) -> None:
        """`restore_state(state)`: the free lists (page ids) set back to `restored` from `current`.
        Pages handed out since are free again without a `free` (EAGLE's draft takes slots with
        `backup_state=True`); pages freed since are held again, by nobody (an orphan with this
        site). Whole-array operations, no value read back (`speculative.taken_since` frees fewer)."""
        xp = self.xp
        n = self.num_pages + 2
        was, now = xp.zeros(n, "int8"), xp.zeros(n, "int8")
        for mark, lists in ((was, restored), (now, current)):
            for tensor in lists:
                pages = xp.index(tensor)
                self._fill(mark, xp.where((pages < 1) | (pages > self.num_pages), self.sink, pages), 1)
        returned = (was == 1) & (now == 0)
        retaken = (now == 1) & (was == 0)
        if self.history is not None:
            self._record(np.flatnonzero(returned), rec.OP_RESTORE_FREE, site, self.owner[returned], unique=True)
            self._record(np.flatnonzero(retaken), rec.OP_RESTORE_HOLD, site, unique=True)
        state = self.state
        freed = xp.cast((state & TREE) | FREE, state)
        self.state[:] = xp.cast(xp.where(returned, freed, xp.where(retaken, OWNED, state)), state)
        self.owner[:] = xp.cast(xp.where(retaken, -1, self.owner), self.owner)
        self.alloc_site[:] = xp.cast(xp.where(retaken, site, self.alloc_site), self.alloc_site)
        self.fill(self.state, 0, RESERVED)
        self.fill(self.state, self.sink, RESERVED)

    def on_tree_insert(self, slots_tensor: Any, site: int) -> None:
        """Slots the tree took over from a request (the part of the key it did not hold yet)."""
        xp = self.xp
        if self.kernels is not None:
            self.kernels.tree_insert(self.kernels.index(slots_tensor), site)
            return
        slots = xp.index(slots_tensor)
        pages = self._pages(slots, site)
        before = self.state[pages]
        freed = ((before & FREE) != 0) & (pages != self.sink)
        if self.history is not None:
            self._record(pages, rec.OP_TREE, site, self.owner[pages])
        self._flag(pages, freed, schema.USE_AFTER_FREE, site)
        self._fill(self.state, pages, TREE)
        self._fill(self.owner, pages, -1)
        self.fill(self.state, self.sink, RESERVED)

    def on_tree_reset(self) -> None:
        self.state[:] = self.xp.cast(self.state & ~TREE, self.state)

    def on_owner(self, slots_tensor: Any, req_index: Any) -> None:
        """A request row now points at these slots (req_to_token writes): they belong to it."""
        xp = self.xp
        if xp.sync_free_branching and self.kernels is None and isinstance(req_index, int):
            slot = xp.single(slots_tensor)
            if slot is not None and 0 <= slot < self.rows:
                page = slot // self.page_size
                if self.state[page] == OWNED and self.owner[page] != req_index:
                    if self.history is not None and page:
                        self.history.one(page, rec.OP_OWNER, 0, req_index)
                    self.owner[page] = req_index
                return
        if self.kernels is not None:
            slots = self.kernels.index(slots_tensor)
            if not isinstance(req_index, int):
                req_index = self.kernels.index(req_index)
                if req_index.shape != slots.shape:
                    return
            self.kernels.owner(slots, req_index)
            return
        slots = xp.index(slots_tensor)
        bad = (slots < 0) | (slots >= self.rows)
        pages = xp.where(bad, self.sink, slots // self.page_size)
        owned = self.state[pages] == OWNED
        if isinstance(req_index, int):
            req = req_index
        else:
            req = xp.index(req_index)
            if req.shape != pages.shape:
                return
        if self.history is not None:
            changed = owned & (self.owner[pages] != req)
            self._record(pages[changed], rec.OP_OWNER, 0, req if isinstance(req, int) else req[changed])
        self.owner[pages] = xp.cast(xp.where(owned, req, self.owner[pages]), self.owner)

    def on_last_loc_alloc(self, last_loc_tensor: Any, req_indices: Any, slots_tensor: Any, site: int, only_page_starts: bool) -> None:
        """A paged alloc's last_loc check and its update, taken together after the host's call (the
        native fast path's way on a GPU: one launch). The call changed no state of this ledger, so
        the check sees what it would have seen before it."""
        if self.kernels is None:
            self.check_last_loc(last_loc_tensor, site, req_indices)
            self.on_alloc(slots_tensor, site, only_page_starts=only_page_starts)
            return
        kernels = self.kernels
        last = kernels.index(last_loc_tensor)
        req = kernels.index(req_indices) if req_indices is not None else None
        req = req if req is not None and req.shape == last.shape else None
        kernels.last_loc_alloc(last, site, req, kernels.index(slots_tensor), only_page_starts and self.page_size > 1)

    def check_last_loc(self, last_loc_tensor: Any, site: int, req_indices: Any = None) -> None:
        """`last_loc` (the slot before the new tokens, -1 for none) must point into a page the
        request still holds: not free, and owned by that request when we know which it is."""
        xp = self.xp
        value = xp.single(last_loc_tensor) if xp.sync_free_branching and self.kernels is None else None
        if value is not None:
            if value == -1:
                return
            if 0 <= value < self.rows:
                page = value // self.page_size
                state = int(self.state[page])
                owner = int(self.owner[page])
                one_req = xp.single(req_indices) if req_indices is not None else -1
                req = -1 if one_req is None else one_req
                if not (state & FREE) and state & (OWNED | TREE) and not (state == OWNED and owner >= 0 and req >= 0 and owner != req):
                    return  # the common, healthy case; anything else takes the general path
        if self.kernels is not None:
            last = self.kernels.index(last_loc_tensor)
            req_all = self.kernels.index(req_indices) if req_indices is not None else None
            self.kernels.last_loc(last, site, req_all if req_all is not None and req_all.shape == last.shape else None)
            return
        last = xp.index(last_loc_tensor)
        pages = self._pages(last, site, allow_minus_one=True)
        st = self.state[pages]
        valid = (last >= 0) & (pages != self.sink)
        stale = valid & (((st & FREE) != 0) | ((st & (OWNED | TREE)) == 0))
        extra, rows = None, -1
        if req_indices is not None:
            req = xp.index(req_indices)
            if req.shape == pages.shape:
                rows = req
                own = self.owner[pages]
                stale = stale | (valid & (st == OWNED) & (own >= 0) & (own != req))
                if xp.sync_free_branching:  # on the host: which requests passed them (the device ledger keeps pages only)
                    extra = {"last_loc_of": self.readback._tally(req, np.flatnonzero(stale), self.requests.describe, weight=1)}
        if self.history is not None and stale.any():
            self._record(pages[stale], rec.OP_LAST_LOC, site, rows if isinstance(rows, int) else rows[stale])
        self._flag(pages, stale, schema.STALE_LAST_LOC, site, extra=extra)
