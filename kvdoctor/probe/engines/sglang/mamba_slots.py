"""SGLang 0.5.20+'s Mamba state slots (`HybridReqToTokenPool.mamba_allocator`, a `MambaSlotAllocator`
over its `MambaPool`: one slot of conv and SSM state per request), judged when the engine is quiet.

With no request live and no hooked call for a whole writer round (the slot ledgers' quiet idle
census and their shutdown census), every slot is free (the allocator's free list), held by the
radix tree (its MAMBA component: SGLang's own `all_mamba_values_flatten()`), or held by a streaming
session's record; any other slot is an orphan. The books are first held to SGLang's own counts
(the free list against `available_size()`, the tree's slots against `mamba_evictable_size() +
mamba_protected_size()`); a census where they differ names nothing and says so. A slot is named
after two quiet censuses in a row found it, with the request that last took it and the site of
that `HybridReqToTokenPool.alloc` (hooked here; its base `ReqToTokenPool.alloc`, which it calls,
gives the row to the slot ledger, and this hook checks that it did).

Never judged from the scheduler's own thread: a prefill pick copies a cached state into a fresh
slot for a waiting request (`match_prefix`) before the request takes a row, and pre-allocates slots
for a pick (`alloc_group_begin`), so a census there could see held slots as nobody's.

Not judged, said once in a `probe_status`: a free list on a device (reading it would synchronise),
the extra buffer's ping-pong slots and the int8 checkpoint pool (held in ways not read here), a
pool past MAX_SLOTS slots.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.engines.sglang.host_slots import NotFollowed, host_ints
from kvdoctor.probe.engines.sglang.mamba_pool import UNKNOWN_TAKER, NotJudged, emit_orphans, host_slots
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

COMPONENT = "mamba_slots"
MAX_SLOTS = 1 << 24  # a census holds a byte a slot while it runs (16 MB at the bound)
MAX_TAKEN = 1 << 16  # slots whose taker is remembered
CENSUSES_TO_NAME = 2


class Takers:
    """Who last took each slot (at most MAX_TAKEN slots remembered): the request's rid, the site,
    and when (a count of the hooked allocs). The scheduler's thread writes them at each hooked
    alloc, a census on the writer's thread forgets those it found free or the tree's: one lock
    between the two, so a slot taken while a census reads keeps its taker."""

    def __init__(self) -> None:
        self.taken: dict[int, tuple[str, int, int]] = {}  # slot -> (rid, site, when)
        self.count = 0
        self.lock = threading.Lock()

    def note(self, slots: list[int], rids: list[str], site: int) -> None:
        with self.lock:
            self.count += 1
            taken, when = self.taken, self.count
            for slot, rid in zip(slots, rids, strict=True):
                if slot in taken or len(taken) < MAX_TAKEN:
                    taken[slot] = (rid, site, when)

    def forget(self, held: np.ndarray, before: int) -> None:
        """Slots `held` (free or the tree's at a census that began at count `before`) are no one's
        to name; one taken since keeps its taker."""
        with self.lock:
            gone = [slot for slot, (_, _, when) in self.taken.items() if when <= before and slot < held.size and held[slot]]
            for slot in gone:
                del self.taken[slot]

    def of(self, slot: int) -> tuple[str, int]:
        rid, site, _ = self.taken.get(slot, (UNKNOWN_TAKER, 0, 0))
        return rid, site


class MambaSlots:
    """Who took each slot, the slots unaccounted at the last quiet census, those named."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.takers = Takers()
        self.unaccounted: set[int] = set()
        self.named: set[int] = set()
        self.off = ""
        self.said: tuple[int, ...] | None = None

    def periodic(self, probe: ProbeContext) -> None:
        return None  # counted at the slot ledgers' quiet censuses

    def close(self, probe: ProbeContext, reason: str) -> None:
        return None

    def stop(self, probe: ProbeContext, why: str) -> None:
        self.off = f"Mamba state slots not judged: {why}"
        probe.emitter.emit(schema.PROBE_STATUS, {"component": COMPONENT, "state": "partial", "reason": self.off})

    def note_taken(self, pool: Any, rows: Any, reqs: list[Any], site: int) -> None:
        """After `pool.alloc(reqs)` gave them `rows`: each request's slot, read in one gather from
        the pool's row-to-slot map (host pools), else from each request's `kv.mamba_pool_idx`."""
        size = getattr(getattr(pool, "mamba_allocator", None), "size", None)
        if not isinstance(size, int) or size > MAX_SLOTS or not reqs:
            return  # the census says why it does not judge
        rids = [str(getattr(req, "rid", "?")) for req in reqs]
        mapping: Any = getattr(pool, "req_index_to_mamba_index_mapping", None)
        if getattr(getattr(mapping, "device", None), "type", "") == "cpu" and isinstance(rows, list) and len(rows) == len(reqs):
            slots = mapping.numpy()[np.asarray(rows, dtype=np.int64)].astype(np.int64)
        else:
            pairs = [
                (slot, rid) for req, rid in zip(reqs, rids, strict=True) for slot in host_slots(getattr(req.kv, "mamba_pool_idx", None))
            ]
            slots, rids = np.asarray([p[0] for p in pairs], dtype=np.int64), [p[1] for p in pairs]
        inside = (slots > 0) & (slots <= size)
        if not inside.all():
            slots, rids = slots[inside], [rid for rid, keep in zip(rids, inside, strict=True) if keep]
        if slots.size:
            self.takers.note(slots.tolist(), rids, site)

    def quiet_census(self, state: Any) -> None:
        """From the slot ledgers' quiet and shutdown censuses (`state`: the engine's `SglangState`):
        each engine's request pool that has a Mamba allocator."""
        for _allocator, requests in list(state.judging.engine_pools_by_allocator.values()):
            if requests is not None and hasattr(requests, "mamba_allocator"):
                self.census(state.probe, requests, state.tree)

    def census(self, probe: ProbeContext, pool: Any, tree: Any) -> None:
        """One quiet census of `pool` (a request pool with a Mamba allocator) against `tree`."""
        if self.off:
            return
        try:
            self._census(probe, pool, tree)
        except (NotJudged, NotFollowed) as exc:
            self.stop(probe, str(exc))
        except Exception as exc:
            self.stop(probe, f"{type(exc).__name__}: {exc}")

    def _census(self, probe: ProbeContext, pool: Any, tree: Any) -> None:
        allocator: Any = getattr(pool, "mamba_allocator", None)
        size = getattr(allocator, "size", None)
        if not isinstance(size, int) or tree is None or not hasattr(tree, "all_mamba_values_flatten"):
            raise NotJudged(f"{type(pool).__name__} has no Mamba allocator with a size, or its tree no Mamba values")
        if type(allocator).__name__ != "MambaSlotAllocator":
            raise NotJudged(f"its Mamba allocator is a {type(allocator).__name__}, whose free list this census does not read")
        if size > MAX_SLOTS:
            raise NotJudged(f"the Mamba pool has {size} slots (more than {MAX_SLOTS})")
        if getattr(pool, "enable_mamba_extra_buffer", False) or getattr(pool, "mamba_ckpt_pool", None) is not None:
            raise NotJudged("the extra buffer's ping-pong slots or the int8 checkpoint pool hold slots this census does not read")
        if getattr(allocator, "_alloc_iter", None) is not None:
            return  # a prefill pick's pre-allocated slots are out (alloc_group_begin): not this round
        takers = self.takers  # the one this census began with (a clear() replaces it)
        before = takers.count  # a slot taken after this is not judged free from what is read next
        free = host_ints(getattr(allocator, "free_slots", None))
        in_tree = host_ints(tree.all_mamba_values_flatten())
        sessions = np.asarray(sorted(session_slots(tree)), dtype=np.int64)
        counted = int(tree.mamba_evictable_size()) + int(tree.mamba_protected_size())
        held = np.zeros(size + 1, dtype=bool)  # slot 0 is SGLang's padding slot, never handed out
        held[0] = True
        for part in (free, in_tree, sessions):
            if part.size and (part.min() < 0 or part.max() > size):
                raise NotJudged(f"slot {int(part.max())} is outside the Mamba pool's {size} slots")
            held[part] = True
        distinct_free, distinct_tree = np.unique(free).size, np.unique(in_tree).size
        disagrees = free.size != int(allocator.available_size()) or distinct_free != free.size or distinct_tree != counted
        orphans = {int(slot) for slot in np.flatnonzero(~held)}
        count = (size, int(free.size), distinct_tree, int(sessions.size), len(orphans), int(disagrees))
        if count != self.said:
            self.said = count
            names = ("slots", "free", "tree", "session_holders", "unaccounted", "books_disagree")
            probe.emitter.emit(schema.MAMBA_POOL, {**dict(zip(names, count, strict=True)), "quiet": True, "tree_counted": counted})
        takers.forget(held, before)  # free or the tree's now: their takers are no longer the ones to name
        if disagrees:
            self.unaccounted = set()
            return  # SGLang's own counts do not match what was read: nothing named from it
        due = sorted((orphans & self.unaccounted) - self.named)
        self.unaccounted = orphans
        self.named &= orphans
        if due:
            self.name(probe, due, size, takers)

    def name(self, probe: ProbeContext, slots: list[int], size: int, takers: Takers) -> None:
        by_site: dict[tuple[str, int], list[int]] = {}
        for slot in slots:
            self.named.add(slot)
            by_site.setdefault(("HybridReqToTokenPool.alloc", takers.of(slot)[1]), []).append(slot)
        # named at quiet censuses (no request live), not at a prefill pick
        emit_orphans(probe, by_site, lambda slot: takers.of(slot)[0], size, quiet=True)


def session_slots(tree: Any) -> set[int]:
    """The Mamba slots streaming sessions hold (their records' `mamba_pool_idx`)."""
    records = getattr(tree, "session_records", None)
    if records is None:
        return set()
    out: set[int] = set()
    for kv in dict(records()).values():
        out.update(host_slots(getattr(kv, "mamba_pool_idx", None)))
        if getattr(kv, "mamba_ping_pong_track_buffer", None) is not None:
            raise NotJudged("a session holds ping-pong track slots")
    return out


def mamba_slots(probe: ProbeContext) -> MambaSlots:
    return probe.state(COMPONENT, MambaSlots)


class HybridAllocRole(Role):
    """`HybridReqToTokenPool.alloc(reqs)`: each request's Mamba slot (taken here, or copied into at
    its prefix match) and who took it."""

    ledger = "slots"
    wants_site = True
    reads = {"reqs": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if result is None:
            return
        slots, reqs = mamba_slots(probe), list(hook.arg(args, kwargs, "reqs") or [])
        engine = probe.states.get("sglang")  # its base alloc's row is in the engine's request table
        live = getattr(getattr(engine, "requests", None), "live", {})
        rows = result if isinstance(result, list) else [getattr(getattr(r, "kv", None), "req_pool_idx", None) for r in reqs]
        unseen = [row for row in rows if row not in live]
        if unseen:  # its base alloc, the hooked one, did not give these rows to the slot ledger
            why = f"HybridReqToTokenPool.alloc gave row {unseen[0]} past the hooked ReqToTokenPool.alloc"
            probe.turn_off_ledger("slots", "the slot ledger", why)
            return
        try:
            slots.note_taken(obj, rows, reqs, ctx)
        except NotJudged as exc:
            slots.stop(probe, str(exc))


class HybridClearRole(Role):
    """`HybridReqToTokenPool.clear()`: every slot free again; nothing it held is anyone's now."""

    ledger = "slots"

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        slots = mamba_slots(probe)
        slots.takers = Takers()
        slots.unaccounted = set()


ROLES: dict[str, Role] = {"hybrid_rows_alloc": HybridAllocRole(), "hybrid_rows_clear": HybridClearRole()}
