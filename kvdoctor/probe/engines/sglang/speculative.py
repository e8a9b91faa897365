"""Speculative decoding's request rows, written with a kernel rather than `ReqToTokenPool.write`.

SGLang's speculative workers (EAGLE, EAGLE3, STANDALONE, DFLASH, UNO, NGRAM from 0.5.14) give each
decode step's draft tokens their slots and write them into the requests' rows with one Triton
kernel, `assign_req_to_token_pool`, called through `assign_req_to_token_pool_func` (0.5.4.post2
on; `sgl_kernel`'s CPU op on SGLang's CPU engine). No hooked pool method sees those rows, so without
this role every slot a live request holds past its prefill looks allocated and never written: an
orphan to the rolling census. Where a release's map hooks no such function, the engine's ledgers
are not judged while it decodes speculatively (`coverage.SpeculativeRows`).

EAGLE's draft (EAGLEWorker, up to 0.5.12) takes its slots with `backup_state=True` and gives them
back with the allocator's `restore_state`, never `free`: `RestoreStateRole`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvdoctor.probe import native
from kvdoctor.probe.base import objects
from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.engines.sglang.state import SglangState, sglang_state
from kvdoctor.probe.ledgers.slots import SlotLedger

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


class ReqWriteSpansRole(Role):
    """`assign_req_to_token_pool_func(req_pool_indices, req_to_token, start_offset, end_offset,
    out_cache_loc, batch_size)`: request `i` of the batch gets `req_to_token[req_pool_indices[i],
    start_offset[i]:end_offset[i]]` from the next `end_offset[i] - start_offset[i]` entries of
    `out_cache_loc`. Each entry's row is worked out on the tensors' device (a cumulative sum and a
    search, no value read back), so a GPU ledger takes it without a synchronisation."""

    ledger = "slots"
    reads = {"req_pool_indices": 0, "req_to_token": 1, "start_offset": 2, "end_offset": 3, "out_cache_loc": 4, "batch_size": 5}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = sglang_state(probe)
        table = hook.arg(args, kwargs, "req_to_token")
        ledger = ledger_of_rows(state, table)
        rows, starts, ends, values = (
            hook.arg(args, kwargs, n) for n in ("req_pool_indices", "start_offset", "end_offset", "out_cache_loc")
        )
        batch_size = hook.arg(args, kwargs, "batch_size")
        if ledger is None or not all(hasattr(t, "numel") for t in (rows, starts, ends, values)) or not isinstance(batch_size, int):
            return
        spans = written_spans(rows, starts, ends, values, batch_size)
        if spans is None:
            return
        slots, owners, batch_rows, batch_ends = spans
        if ledger.xp.sync_free_branching:
            note_row_ends(state, table, batch_rows, batch_ends)
        with ledger.lock:
            ledger.on_owner(slots, owners)


class RestoreStateRole(Role):
    """`restore_state(state)`: the allocator's free lists set back to what `backup_state()` returned
    (`(free_pages, release_pages)`); what was handed out since is free again, with no `free` call.
    A state of another shape (an SWA allocator's own pair of states) is left alone."""

    ledger = "slots"
    wants_site = True
    reads = {"state": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        current = (objects.own(obj, "free_pages"), objects.own(obj, "release_pages"))
        if not all(hasattr(t, "numel") for t in current):
            return None
        return (sglang_state(probe).ledger_for(obj), site, current)

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if ctx is None:
            return
        ledger, site, current = ctx
        restored = hook.arg(args, kwargs, "state")
        if not isinstance(restored, tuple) or len(restored) != 2 or not all(hasattr(t, "numel") for t in restored):
            return
        taken = taken_since(restored, current)
        with ledger.lock:
            if taken is not None:  # a free of what was taken, in the pages taken, not in the pool
                ledger.on_free(taken, site, evicting=False, as_pages=True)
            else:
                ledger.on_restore(restored, current, site)


def taken_since(restored: tuple[Any, Any], current: tuple[Any, Any]) -> Any:
    """The pages the allocator handed out since `backup_state`, where that is all it did: nothing
    freed (the release list is the same tensor) and the free list now a view of the restored one
    with its front taken off, as every SGLang allocator's `alloc` leaves it. None otherwise (a
    free, a merge of the lists): `on_restore` then compares the lists whole. Reads only tensor
    metadata, never a value."""
    (old_free, old_release), (new_free, new_release) = restored, current
    if new_release is not old_release:
        return None
    try:
        if old_free.dim() != 1 or new_free.dim() != 1 or old_free.dtype != new_free.dtype or old_free.device != new_free.device:
            return None
        if (old_free.numel() > 1 and old_free.stride(0) != 1) or (new_free.numel() > 1 and new_free.stride(0) != 1):
            return None
        if old_free.untyped_storage().data_ptr() != new_free.untyped_storage().data_ptr():
            return None
        taken = int(new_free.storage_offset()) - int(old_free.storage_offset())
        if taken < 0 or taken + new_free.numel() != old_free.numel():
            return None
        return old_free[:taken]
    except Exception:  # not a torch tensor as the allocator keeps it: compare the lists whole
        return None


def written_spans(rows: Any, starts: Any, ends: Any, values: Any, batch_size: int) -> tuple[Any, Any, Any, Any] | None:
    """The kernel's writes as (slot, row) pairs on the values' device: entry `j` of `values` goes to
    the request whose span of the flat list holds it; an entry past the last span is not written
    (its slot is given as -1, which no ledger page takes). Also the batch's rows and the end of each
    row's span (0 for an empty one). None for an empty batch."""
    import torch

    n = min(batch_size, rows.numel(), starts.numel(), ends.numel())
    if n <= 0 or values.numel() == 0:
        return None
    device = values.device
    batch_rows = rows.reshape(-1)[:n].to(device=device, dtype=torch.int64)
    batch_ends = ends.reshape(-1)[:n].to(device=device, dtype=torch.int64)
    lengths = (batch_ends - starts.reshape(-1)[:n].to(device=device, dtype=torch.int64)).clamp(min=0)
    which = torch.searchsorted(torch.cumsum(lengths, 0), torch.arange(values.numel(), device=device), right=True)
    owners = batch_rows[which.clamp(max=n - 1)]
    slots = torch.where(which < n, values.reshape(-1).to(torch.int64), -1)
    return slots, owners, batch_rows, torch.where(lengths > 0, batch_ends, 0)


def ledger_of_rows(state: SglangState, table: Any) -> SlotLedger | None:
    """The ledger of the allocator whose request pool holds `table` (its `req_to_token`); the first
    ledger while no pool is known, as `ReqToTokenPool.write` is read. None for another pool's rows
    (a draft model's own pool): they are not this allocator's slots."""
    for allocator, requests in state.judging.engine_pools_by_allocator.values():
        if requests is not None and objects.own(requests, "req_to_token") is table:
            return state.ledgers.get(id(allocator))
    return state.primary if not state.judging.engine_pools_by_allocator else None


def note_row_ends(state: SglangState, table: Any, rows: Any, ends: Any) -> None:
    """Host pools: rows written up to `ends`, so that each row's release is checked as far as it
    was written (as `SglangState.note_row_write` does for `ReqToTokenPool.write`)."""
    extent = state.row_extent
    if extent is None:
        if getattr(table, "device", None) is None or table.device.type != "cpu" or len(table.shape) != 2:
            return
        extent = state.row_extent = np.zeros(int(table.shape[0]), dtype=np.int64)
        native.set_row_extent(extent)
    if int(table.shape[0]) != extent.size:
        return  # not the table the releases are checked against
    r, e = rows.numpy().reshape(-1), ends.numpy().reshape(-1)
    inside = (r >= 0) & (r < extent.size)
    np.maximum.at(extent, r[inside], e[inside])
