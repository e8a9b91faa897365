"""Who held a vLLM block pool's references when the probe came to an engine core that had served.

The block ledger takes vLLM's own `ref_cnt` of every block, so that giving back what was held then
is no double free. Which of those references a holder explains is read from the engine's own
objects, found from the call the probe met (each caller's `self`: a single-type manager, the
coordinator, the KV cache manager, the scheduler):

- each request's blocks in every manager's `req_to_blocks` (one reference per listed block);
- the blocks a deferred free still holds (`Scheduler.deferred_frees`, 0.28 on) and each manager's
  pending copy-on-write pairs;
- the blocks the call in progress is freeing (popped from `req_to_blocks` a moment before).

The books are proven before anything is named: every manager of the pool was read, the scheduler
was found and has no KV connector (whose holds are not in `req_to_blocks`), no block has more
holders than references, and vLLM's free queue holds exactly the blocks whose count is 0. Then a
reference no holder explains was taken before the probe came and never given back: leaked before
attach, named so by a census that finds it still held. Otherwise nothing is named, and the caller
says why. Only instance attributes and the blocks' dataclass slots are read (no property, no host code);
nothing is changed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from kvdoctor.probe.base.objects import own

MAX_FRAMES = 64
DEFERRED_FREE = "a deferred free (Scheduler.deferred_frees)"
PENDING_COPY = "a pending copy-on-write"
CALL_IN_PROGRESS = "the free in progress"


@dataclass
class Holders:
    """What the engine's objects explain: block id -> one holder name per reference."""

    by_block: dict[int, list[str]] = field(default_factory=dict)
    requests: set[str] = field(default_factory=set)
    reason: str = ""  # why the books are not proven ('' when they are)


def _engine_objects(pool: Any) -> tuple[Any, Any]:
    """The coordinator and the scheduler of the engine that owns `pool`, from the callers' `self`."""
    coordinator = scheduler = None
    frame: FrameType | None = sys._getframe(2)
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        obj = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if obj is not None and obj is not pool:
            if coordinator is None and own(obj, "single_type_managers") is not None:
                coordinator = obj
            if coordinator is None and own(obj, "coordinator") is not None:
                coordinator = own(obj, "coordinator")
            manager = own(obj, "kv_cache_manager")
            if scheduler is None and manager is not None:
                scheduler = obj
                coordinator = coordinator or own(manager, "coordinator")
        frame = frame.f_back
    return coordinator, scheduler


def _block_ids(blocks: Any, pool: Any, num_blocks: int) -> Iterable[int]:
    for block in blocks if isinstance(blocks, (list, tuple)) else ():
        # KVCacheBlock is a slotted dataclass: its fields are plain slots, read as the ledger reads them
        if getattr(block, "is_null", False) is True:
            continue
        owner = getattr(block, "pool", None)
        bid = getattr(block, "block_id", None)
        if (owner is None or owner is pool) and isinstance(bid, int) and 0 <= bid < num_blocks:
            yield bid


def read_holders(pool: Any, ref: Any, in_flight: Any, null_block_id: int | None) -> Holders:
    """The holders of `pool`'s references `ref` (vLLM's ref_cnt per block, read just before)."""
    out = Holders()
    num_blocks = len(ref)
    coordinator, scheduler = _engine_objects(pool)
    managers = [m for m in own(coordinator, "single_type_managers") or () if own(m, "block_pool") is pool] if coordinator else []
    if not managers:
        out.reason = "the engine's KV cache managers of this pool were not among the callers the probe met"
        return out
    if scheduler is None:
        out.reason = "the engine's scheduler was not among the callers the probe met"
        return out
    if own(scheduler, "connector") is not None:
        out.reason = "a KV connector is on, and the blocks it holds are not listed in the managers the probe reads"
        return out

    def hold(blocks: Any, name: str) -> None:
        for bid in _block_ids(blocks, pool, num_blocks):
            out.by_block.setdefault(bid, []).append(name)

    for manager in managers:
        table = own(manager, "req_to_blocks")
        if not isinstance(table, dict):
            out.reason = f"{type(manager).__name__} has no request table the probe can read"
            return out
        for rid, blocks in list(table.items()):
            hold(blocks, str(rid))
            out.requests.add(str(rid))
        for pair in own(manager, "_pending_cow_copies") or ():
            hold(list(pair) if isinstance(pair, tuple) else [], PENDING_COPY)
    for entry in list(own(scheduler, "deferred_frees") or ()):
        hold(entry[1] if isinstance(entry, tuple) and len(entry) == 2 else [], DEFERRED_FREE)
    hold(in_flight, CALL_IN_PROGRESS)
    over = [bid for bid, names in out.by_block.items() if len(names) > ref[bid]]
    if over:
        out.reason = (
            f"{len(over)} block(s) have more holders than references (block {over[0]}: {len(out.by_block[over[0]])} > {ref[over[0]]})"
        )
        return out
    free_queue = own(own(pool, "free_block_queue"), "num_free_blocks")
    zero = sum(1 for bid in range(num_blocks) if ref[bid] == 0 and bid != null_block_id)
    if free_queue != zero:
        out.reason = f"vLLM's free queue holds {free_queue} block(s), but {zero} have no reference"
    return out
