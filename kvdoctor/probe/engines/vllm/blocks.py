"""The ledger of one vLLM `BlockPool`: our own reference count per KV block, who holds it, and
where it was allocated.

vLLM's blocks are shared: a prefix-cache hit (`touch`) adds a reference to a block another
request already holds, and a block whose count falls to 0 stays cached (hashed) in the free queue
until it is handed out again. So the ledger keeps a count per block, not an owner: +1 for each
block `get_new_blocks` hands out and for each block `touch` hits, -1 for each block `free_blocks`
(or `unpin_blocks`) returns. Its rules:

- `double_alloc`: `get_new_blocks` hands out a block whose count is not 0;
- `double_free`: a free would take a block's count below 0 (vLLM's `free_blocks` does not check),
  or vLLM's free queue grew by more blocks than the free released (a block queued twice);
- at a census (the engine idle, or exiting): orphan blocks are blocks with a count above 0 that no
  live request holds (when idle: every such block); and vLLM's own `ref_cnt` and free queue are
  compared with the ledger (`refcount_disagrees`).

Memory is bounded: counts and allocation sites are two arrays of the pool's size; the requests
holding a block are kept only while its count is above 0, at most `MAX_HOLDERS` names per block.
Slot counts in events are blocks x block_size, so detectors written for slots read them as is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvdoctor.trace import schema

MAX_HOLDERS = 4  # request ids remembered per block (a block may be shared by many)
MAX_IDS_IN_EVIDENCE = 64  # ids listed in one event
MAX_NAMED = 4096  # blocks whose sites/requests are tallied in one event
MANY = "(more requests)"


class BlockLedger:
    def __init__(
        self,
        *,
        name: str,
        num_blocks: int,
        block_size: int,
        null_block_id: int | None,
        emit: Callable[..., None],
        site_name: Callable[[int], str],
    ) -> None:
        self.name = name
        self.num_blocks = int(num_blocks)
        self.block_size = max(1, int(block_size))
        self.null_block_id = null_block_id
        self.emit = emit
        self.site_name = site_name
        self.ref = np.zeros(self.num_blocks, dtype=np.int32)
        self.alloc_site = np.zeros(self.num_blocks, dtype=np.int32)
        self.holders: dict[int, list[str]] = {}
        self.lock = threading.Lock()
        self.stats = {
            "allocated_blocks": 0,
            "touched_blocks": 0,
            "freed_blocks": 0,
            "evicted_blocks": 0,
            "cached_blocks": 0,
            "double_free_blocks": 0,
            "double_alloc_blocks": 0,
        }
        self.census_count = 0
        # references a pool already had when the probe came (attach) whose holders are not proven:
        # a block is judged only once they are all given back (None: the probe saw the pool fresh)
        self.adopted: np.ndarray | None = None
        # references no holder explained when the probe came, the holders proven (leaked before attach)
        self.before_attach: np.ndarray | None = None

    def adopt(self, pool: Any, site: int) -> int:
        """Takes vLLM's own `ref_cnt` of every block as the ledger's count when the pool is already
        in use (so freeing what was held before is no double free); returns the blocks adopted."""
        blocks = pool.blocks
        host = np.fromiter((max(0, int(b.ref_cnt)) for b in blocks), dtype=np.int32, count=len(blocks))
        if host.size != self.num_blocks:
            return 0
        if self.null_block_id is not None and 0 <= self.null_block_id < self.num_blocks:
            host[self.null_block_id] = 0
        held = np.nonzero(host > 0)[0]
        if not held.size:
            return 0
        with self.lock:
            self.ref[:] = host
            self.adopted = host.copy()
            self.alloc_site[held] = site
            for bid in held:
                self.holders[int(bid)] = [schema.HOLDER_AT_ATTACH]
        return int(held.size)

    def prove_adoption(self, by_block: dict[int, list[str]], site_before: int) -> int:
        """The adopted references' holders were read and the books balance: each block's holders
        are named, and references no holder explains are leaked before attach (counted per block
        in `before_attach`, their site `site_before`). From now on every block is judged. Returns
        the blocks with such references."""
        with self.lock:
            if self.adopted is None:
                return 0
            early = np.maximum(self.adopted - np.fromiter((len(by_block.get(b, ())) for b in range(self.num_blocks)), np.int32), 0)
            for bid in np.nonzero(self.adopted > 0)[0]:
                names = list(dict.fromkeys(by_block.get(int(bid), ())))[:MAX_HOLDERS]
                if early[bid]:
                    names = [*names[: MAX_HOLDERS - 1], schema.OWNER_BEFORE_ATTACH]
                    self.alloc_site[bid] = site_before
                self.holders[int(bid)] = names
            self.adopted = None
            self.before_attach = early
            return int(np.count_nonzero(early))

    # ----- helpers -----

    def _ids(self, blocks: list[Any], pool: Any) -> list[int]:
        """Block ids of this pool's blocks in `blocks` (the null block and other pools' blocks skipped)."""
        out = []
        n = self.num_blocks
        for block in blocks:
            if getattr(block, "is_null", False):
                continue
            owner = getattr(block, "pool", None)
            if owner is not None and owner is not pool:
                continue
            bid = block.block_id
            if 0 <= bid < n:
                out.append(bid)
        return out

    def _slot_ids(self, block_ids: list[int] | np.ndarray) -> list[int]:
        bs = self.block_size
        out: list[int] = []
        for bid in list(block_ids)[: max(1, MAX_IDS_IN_EVIDENCE // bs)]:
            out.extend(range(int(bid) * bs, int(bid) * bs + bs))
        return out[:MAX_IDS_IN_EVIDENCE]

    def _tally(self, block_ids: list[int] | np.ndarray) -> tuple[dict[str, int], dict[str, int]]:
        sites: dict[str, int] = {}
        reqs: dict[str, int] = {}
        bs = self.block_size
        for bid in list(block_ids)[:MAX_NAMED]:
            bid = int(bid)
            site = self.site_name(int(self.alloc_site[bid]))
            sites[site] = sites.get(site, 0) + bs
            names = self.holders.get(bid) or ["unknown request"]
            for rid in [n for n in names if n != MANY] or names:
                reqs[rid] = reqs.get(rid, 0) + bs
        return sites, reqs

    def _violation(self, kind: str, block_ids: list[int], site: int, request: str | None, note: str) -> None:
        sites, reqs = self._tally(block_ids)
        self.emit(
            schema.VIOLATION,
            {
                "kind": kind,
                "allocator": self.name,
                "count": len(block_ids) * self.block_size,
                "blocks": len(block_ids),
                "block_size": self.block_size,
                "site": self.site_name(site),
                "slot_ids": self._slot_ids(block_ids),
                "block_ids": [int(b) for b in block_ids[:MAX_IDS_IN_EVIDENCE]],
                "requests": {request: len(block_ids) * self.block_size} if request else reqs,
                "allocated_at": sites,
                "note": note,
            },
        )

    # ----- events from the hooks (callers hold self.lock) -----

    def on_alloc(self, blocks: list[Any], pool: Any, site: int, request: str | None) -> None:
        ids = self._ids(blocks, pool)
        if not ids:
            return
        ref = self.ref
        bad = [b for b in ids if ref[b] != 0]
        if bad:
            self.stats["double_alloc_blocks"] += len(bad)
            self._violation(
                schema.DOUBLE_ALLOC, bad, site, request, "get_new_blocks handed out block(s) the ledger counts as still referenced"
            )
        holder = request or "unattributed"
        adopted, early = self.adopted, self.before_attach
        for bid in ids:
            if adopted is not None:
                adopted[bid] = 0
            if early is not None:
                early[bid] = 0
            ref[bid] = 1
            self.alloc_site[bid] = site
            self.holders[bid] = [holder]
        self.stats["allocated_blocks"] += len(ids)

    def on_touch(self, blocks: list[Any], pool: Any, request: str | None) -> None:
        ids = self._ids(blocks, pool)
        ref = self.ref
        holder = request or "unattributed"
        for bid in ids:
            ref[bid] += 1
            held = self.holders.get(bid)
            if held is None:
                self.holders[bid] = [holder]
            elif holder not in held:
                if len(held) < MAX_HOLDERS:
                    held.append(holder)
                elif held[-1] != MANY:
                    held[-1] = MANY
        self.stats["touched_blocks"] += len(ids)

    def on_free(self, blocks: list[Any], pool: Any, site: int, request: str | None) -> None:
        ids = self._ids(blocks, pool)
        ref = self.ref
        adopted, early = self.adopted, self.before_attach
        bad = []
        for bid in ids:
            if ref[bid] <= 0:
                bad.append(bid)
                continue
            ref[bid] -= 1
            if adopted is not None and adopted[bid] > ref[bid]:
                adopted[bid] = ref[bid]  # a reference from before the probe came was given back
            if early is not None and early[bid] > ref[bid]:
                early[bid] = ref[bid]
            if ref[bid] == 0:
                self.holders.pop(bid, None)
            elif request is not None:
                held = self.holders.get(bid)
                if held and request in held and len(held) > 1:
                    held.remove(request)
        self.stats["freed_blocks"] += len(ids) - len(bad)
        if bad:
            self.stats["double_free_blocks"] += len(bad)
            self._violation(schema.DOUBLE_FREE, bad, site, request, "free_blocks returned block(s) whose reference count was already 0")

    def check_queued(self, blocks: list[Any], pool: Any, grew: int, site: int, request: str | None) -> None:
        """After a free: vLLM's free queue grew by `grew`, which must be the distinct blocks of the
        call whose own `ref_cnt` is now 0, each queued once. More is a block queued twice (vllm#42571:
        0.22's `free_blocks` queued a block listed twice once per listing), named with the blocks
        the call listed more than once."""
        if grew <= 0 or grew <= len({id(b) for b in blocks if b.ref_cnt == 0 and not b.is_null}):
            return  # the common case, in one pass (blocks of another pool only widen this bound)
        listed = self._ids(blocks, pool)
        mine = [b for b in blocks if not b.is_null and getattr(b, "pool", None) in (None, pool)]
        released = {b.block_id for b in mine if b.ref_cnt == 0}
        if grew <= len(released):
            return
        named = sorted(bid for bid in released if listed.count(bid) > 1) or sorted(released)
        self.stats["double_free_blocks"] += grew - len(released)
        note = (
            f"free_blocks put {grew} block(s) on vLLM's free queue for {len(released)} it released: a block listed twice was queued twice"
        )
        self._violation(schema.DOUBLE_FREE, named, site, request, note)

    def on_evict(self, evicted: bool) -> None:
        if evicted:
            self.stats["evicted_blocks"] += 1

    def on_cache(self, count: int) -> None:
        self.stats["cached_blocks"] += max(0, int(count))

    # ----- census -----

    def census(
        self,
        *,
        reason: str,
        live_requests: set[str],
        pool: Any = None,
        held_requests: set[str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Counts every block; `pool` (vLLM's own) is read for the cross-check when given.
        `held_requests` finished, but a KV connector still keeps their blocks: those blocks are
        counted apart (`connector_held_blocks`), never as orphans; `extra` joins the event."""
        held_requests = held_requests or set()
        with self.lock:
            self.census_count += 1
            ref = self.ref.copy()
            body = np.ones(self.num_blocks, dtype=bool)
            if self.null_block_id is not None and 0 <= self.null_block_id < self.num_blocks:
                body[self.null_block_id] = False
            unproven = (self.adopted > 0) & body if self.adopted is not None else np.zeros(self.num_blocks, dtype=bool)
            held = (ref > 0) & body & ~unproven
            idle = not live_requests
            connector_held = 0
            if idle and not held_requests:
                orphan = np.nonzero(held)[0]
            else:
                orphan_list = []
                for bid in np.nonzero(held)[0][: MAX_NAMED * 4]:
                    names = self.holders.get(int(bid)) or []
                    if held_requests and any(n in held_requests for n in names):
                        connector_held += 1
                        continue
                    if MANY in names or any(n in live_requests for n in names):
                        continue
                    orphan_list.append(int(bid))
                orphan = np.asarray(orphan_list, dtype=np.int64)
            sites, reqs = self._tally(orphan)
            early = orphan[self.before_attach[orphan] > 0] if self.before_attach is not None and orphan.size else orphan[:0]
            bs = self.block_size
            free_blocks = int(np.count_nonzero((ref == 0) & body))
            args: dict[str, Any] = {
                "allocator": self.name,
                "reason": reason,
                "idle": idle,
                "engine": "vllm",
                "block_size": bs,
                "page_size": bs,
                "live_requests": len(live_requests),
                "total_blocks": int(np.count_nonzero(body)),
                "total_slots": int(np.count_nonzero(body)) * bs,
                "free_blocks": free_blocks,
                "free_slots": free_blocks * bs,
                "held_blocks": int(np.count_nonzero((ref > 0) & body)),
                "owned_slots": int(np.count_nonzero((ref > 0) & body)) * bs,
                "shared_blocks": int(np.count_nonzero((ref > 1) & body)),
                "orphan_blocks": int(orphan.size),
                "orphan_slots": int(orphan.size) * bs,
                "orphan_slot_ids": self._slot_ids(orphan),
                "orphan_block_ids": [int(b) for b in orphan[:MAX_IDS_IN_EVIDENCE]],
                "orphan_allocated_at": sites,
                "orphan_requests": reqs,
                "orphan_before_attach_slots": int(early.size) * bs,
                "orphan_before_attach_slot_ids": self._slot_ids(early),
                "connector_held_blocks": connector_held,
                "unproven_blocks": int(np.count_nonzero(unproven)),
                "unproven_slots": int(np.count_nonzero(unproven)) * bs,
                **self.stats,
                **(extra or {}),
            }
            if pool is not None:
                args.update(self._compare_with_host(ref, body, pool))
        bad = args.pop("_disagree_ids", [])
        self.emit(schema.CENSUS, args)
        if args.get("refcount_disagrees_blocks"):
            self.emit(
                schema.VIOLATION,
                {
                    "kind": schema.REFCOUNT_DISAGREES,
                    "allocator": self.name,
                    "count": args["ledger_disagrees_slots"],
                    "blocks": args["refcount_disagrees_blocks"],
                    "block_size": bs,
                    "site": f"{reason} census",
                    "slot_ids": self._slot_ids(bad),
                    "block_ids": bad[:MAX_IDS_IN_EVIDENCE],
                    "host_free_blocks": args.get("host_free_blocks"),
                    "ledger_free_blocks": free_blocks,
                    "note": "vLLM's own block.ref_cnt differs from the ledger's count: a path kvdoctor does not "
                    "hook changed reference counts, or vLLM's count went wrong",
                },
            )
        return args

    def _compare_with_host(self, ref: np.ndarray, body: np.ndarray, pool: Any) -> dict[str, Any]:
        """vLLM's `ref_cnt` per block and its free queue's length, against the ledger."""
        try:
            blocks = pool.blocks
            host = np.fromiter((b.ref_cnt for b in blocks), dtype=np.int64, count=len(blocks))
            host_free = int(pool.free_block_queue.num_free_blocks)
        except Exception:
            return {}
        if host.size != ref.size:
            return {}
        differ = np.nonzero((host != ref) & body)[0]
        ledger_free = int(np.count_nonzero((ref == 0) & body))
        bs = self.block_size
        return {
            "host_free_blocks": host_free,
            "host_free_slots": host_free * bs,
            "free_queue_disagrees_blocks": abs(host_free - ledger_free),
            "refcount_disagrees_blocks": int(differ.size),
            "ledger_disagrees_slots": int(differ.size) * bs if differ.size else abs(host_free - ledger_free) * bs,
            "_disagree_ids": [int(b) for b in differ[:MAX_IDS_IN_EVIDENCE]],
        }

    def counter_args(self) -> dict[str, Any]:
        body_free = int(np.count_nonzero(self.ref == 0)) - (1 if self.null_block_id is not None else 0)
        return {
            "allocator": self.name,
            "total_slots": (self.num_blocks - (1 if self.null_block_id is not None else 0)) * self.block_size,
            "free_slots": max(0, body_free) * self.block_size,
            "owned_slots": int(np.count_nonzero(self.ref > 0)) * self.block_size,
        }
