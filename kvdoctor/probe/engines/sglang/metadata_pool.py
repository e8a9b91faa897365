"""SGLang's PD metadata buffer rows (`ReqToMetadataIdxAllocator`): every row index is free or held by
the request that took it; a double free, a free outside the pool and a row held by no live request
are named.

PD disaggregation gives each request one row of the metadata buffers (its first output token,
logprobs, hidden states) on the prefill (`PrefillBootstrapQueue.ensure_metadata_buffer`) and on the
decode server (`DecodePreallocQueue._send_kv_metadata`): `alloc()` pops the left of a deque of free
indices, `free(i)` appends to it and checks nothing. An index freed twice is listed twice, and the
deque hands it to two requests, whose transfers then write one row; an index outside the pool is a
row no buffer has.

The ledger keeps, per allocator, the free indices (with the site of their free) and the held ones
(the alloc's call site, the request, and a weak reference to the object that holds it: the caller's
`req` or `decode_req`, read from its frame once per alloc). At the engine's idle census (the writer's
round once no hooked call ran for a whole round) and at exit it first balances its books against the
allocator's own `free_slots` (the same indices free, none listed twice); only then a held index
whose holder is gone, or no longer names it in `metadata_buffer_index`, is named leaked, with its
request and the alloc's call site. Otherwise the census says it cannot judge, and why. No tensor is
read: the indices are Python ints.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import deque
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.base.rank import ledger_name
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

LEDGER = "metadata"
POOL_CLASS = "ReqToMetadataIdxAllocator"
MAX_POOLS = 16
MAX_SIZE = 1 << 20  # a pool with more rows than this is not followed
MAX_FRAMES = 8  # caller frames searched for the request an alloc serves
NAMED = 64  # indices listed in one event
HOLDERS = ("decode_req", "req")  # the caller's local that receives the index (decode, prefill)
BEFORE = "held before the probe met the allocator"


class NotJudged(Exception):
    """The allocator is not laid out as this ledger reads it."""


class Pool:
    """One allocator's books: free index -> site of its free (0: free when met), held index -> (alloc
    site, request, weak reference to its holder or None), the indices already named, the last count."""

    __slots__ = ("ref", "name", "size", "free", "held", "named", "said")

    def __init__(self, allocator: Any, name: str, size: int, listed: list[int]) -> None:
        self.ref = weakref.ref(allocator)
        self.name, self.size = name, size
        self.free: dict[int, int] = dict.fromkeys(listed, 0)
        self.held: dict[int, tuple[int, str, Any]] = {i: (0, BEFORE, None) for i in range(size) if i not in self.free}
        self.named: set[int] = set()
        self.said: tuple[Any, ...] | None = None


def read_allocator(allocator: Any) -> tuple[int, list[int]]:
    size, free = getattr(allocator, "size", None), getattr(allocator, "free_slots", None)
    if not isinstance(size, int) or not isinstance(free, deque):
        raise NotJudged(f"{type(allocator).__name__} has no int size and free_slots deque (found {type(free).__name__})")
    if size > MAX_SIZE:
        raise NotJudged(f"{type(allocator).__name__} has {size} rows (more than {MAX_SIZE})")
    return size, list(free)  # one C-level copy: no hooked call runs inside it


def holder_in_frames() -> Any:
    """The nearest caller's request that takes the index (`decode_req`, `req`), or None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        found = frame.f_locals
        for name in HOLDERS:
            obj = found.get(name)
            if obj is not None and hasattr(obj, "metadata_buffer_index"):
                return obj
        frame = frame.f_back
    return None


def request_id(holder: Any) -> str:
    rid = getattr(holder, "rid", None)
    if rid is None:
        rid = getattr(getattr(holder, "req", None), "rid", None)
    return "unknown (the caller holds no request)" if rid is None else str(rid)


class MetadataPoolLedger:
    """Per process: the allocators met (weakly) and their books; the hooked-call count of the last
    writer round and the change count of the last census, for the idle census."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.lock = threading.Lock()
        self.pools: dict[int, Pool] = {}
        self.changes = 0
        self.census_changes = 0
        self.calls_last = -1

    def pool(self, allocator: Any) -> Pool | None:
        known = self.pools.get(id(allocator))
        if known is not None and known.ref() is allocator:
            return known
        if known is None and len(self.pools) >= MAX_POOLS:
            return None
        size, listed = read_allocator(allocator)
        made = Pool(allocator, ledger_name(POOL_CLASS, len(self.pools)), size, listed)
        with self.lock:
            self.pools[id(allocator)] = made
            self.changes += 1
        return made

    def took(self, pool: Pool, index: int, site: int, holder: Any) -> None:
        try:
            ref = weakref.ref(holder) if holder is not None else None
        except TypeError:
            ref = None
        with self.lock:
            pool.free.pop(index, None)
            pool.held[index] = (site, request_id(holder), ref)
            pool.named.discard(index)
            self.changes += 1

    def gave_back(self, probe: ProbeContext, pool: Pool, index: int, site: int) -> None:
        """Before the host's `free(index)`: out of range or already free is named at this site."""
        if not 0 <= index < pool.size:
            self.violation(probe, schema.METADATA_INDEX_OUT_OF_RANGE, pool, site, [index], pool_rows=pool.size)
            return
        with self.lock:
            first = pool.free.get(index)
            if first is None:
                pool.held.pop(index, None)
                pool.named.discard(index)
                pool.free[index] = site
                self.changes += 1
        if first is not None:
            freed = probe.sites.name(first) if first else "free when the probe met the allocator"
            self.violation(probe, schema.METADATA_DOUBLE_FREE, pool, site, [index], first_free=freed, pool_rows=pool.size)

    def violation(self, probe: ProbeContext, kind: str, pool: Pool, site: int, indices: list[int], **evidence: Any) -> None:
        args = {"kind": kind, "count": len(indices), "allocator": pool.name, "site": probe.sites.name(site) if site else "unknown"}
        probe.emitter.emit(schema.VIOLATION, {**args, "slot_ids": indices[:NAMED], **evidence})

    # ----- censuses -----

    def periodic(self, probe: ProbeContext) -> None:
        """The idle census: no hooked call since the last round, and the books changed since the last census."""
        calls = probe.calls
        quiet, self.calls_last = calls == self.calls_last, calls
        if quiet and self.changes != self.census_changes and probe.ledger_is_on(LEDGER):
            self.census_all(probe, "idle")

    def close(self, probe: ProbeContext, reason: str) -> None:
        if probe.ledger_is_on(LEDGER):
            self.census_all(probe, reason, force=True)

    def census_all(self, probe: ProbeContext, when: str, force: bool = False) -> None:
        self.census_changes = self.changes
        for pool in list(self.pools.values()):
            allocator = pool.ref()
            if allocator is not None:
                try:
                    self.census(probe, pool, allocator, when, force)
                except NotJudged as exc:
                    turn_off(probe, exc)
                    return

    def census(self, probe: ProbeContext, pool: Pool, allocator: Any, when: str, force: bool) -> None:
        _, listed = read_allocator(allocator)
        leaked: dict[int, tuple[int, str, str]] = {}
        with self.lock:
            twice = len(listed) - len(set(listed))
            behind = sorted(set(listed) ^ pool.free.keys())
            unread = before = 0
            for index, (site, rid, ref) in pool.held.items():
                if ref is None:
                    before += rid == BEFORE
                    unread += rid != BEFORE
                    continue
                holder = ref()
                if holder is None or getattr(holder, "metadata_buffer_index", None) != index:
                    why = "its request is gone" if holder is None else f"its request now names row {holder.metadata_buffer_index}"
                    leaked[index] = (site, rid, why)
            due = [i for i in leaked if i not in pool.named] if not (twice or behind) else []
            pool.named.update(due)
        count: dict[str, Any] = {"pool": pool.name, "when": when, "rows": pool.size, "free": len(listed), "held": len(pool.held)}
        count.update(held_before_probe=before, holders_not_read=unread, leaked=len(leaked), judged=not (twice or behind))
        if twice or behind:
            count["leaked"] = 0
            count["not_judged"] = (
                f"its books do not balance with {POOL_CLASS}.free_slots: "
                + (f"{twice} index(es) listed twice; " if twice else "")
                + (
                    f"{len(behind)} index(es) free in one and not the other (e.g. {behind[:8]}), moved by a path the probe does not hook"
                    if behind
                    else ""
                )
            ).rstrip("; ")
        key = tuple(sorted(count.items()))
        if force or key != pool.said:
            pool.said = key
            probe.emitter.emit(schema.METADATA_POOL, count)
        by_site: dict[tuple[int, str], list[int]] = {}
        for index in due:
            by_site.setdefault((leaked[index][0], leaked[index][2]), []).append(index)
        for (site, why), indices in by_site.items():
            requests: dict[str, int] = {}
            for index in indices:
                requests[leaked[index][1]] = requests.get(leaked[index][1], 0) + 1
            self.violation(
                probe, schema.METADATA_ROWS_LEAKED, pool, site, indices, requests=requests, why=why, pool_rows=pool.size, when=when
            )


def state(probe: ProbeContext) -> MetadataPoolLedger:
    return probe.state(LEDGER, MetadataPoolLedger)


def turn_off(probe: ProbeContext, exc: Exception) -> None:
    probe.turn_off_ledger(LEDGER, "the PD metadata row ledger", f"metadata buffer rows not judged: {exc}")


def as_index(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class MetadataAllocRole(Role):
    """`ReqToMetadataIdxAllocator.alloc()`: the index returned is held by the caller's request."""

    ledger = LEDGER
    wants_site = True

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        index = as_index(result)
        if index is None:
            return  # None: the pool is full, nothing was taken
        ledger = state(probe)
        try:
            pool = ledger.pool(obj)
        except NotJudged as exc:
            turn_off(probe, exc)
            return
        if pool is not None:
            ledger.took(pool, index, ctx, holder_in_frames())


class MetadataFreeRole(Role):
    """`ReqToMetadataIdxAllocator.free(free_index)`: checked before the host appends it."""

    ledger = LEDGER
    wants_site = True
    reads = {"free_index": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        index = as_index(hook.arg(args, kwargs, "free_index"))
        if index is None:
            return None
        ledger = state(probe)
        try:
            pool = ledger.pool(obj)
        except NotJudged as exc:
            turn_off(probe, exc)
            return None
        if pool is not None:
            ledger.gave_back(probe, pool, index, site)
        return None


ROLES: dict[str, Role] = {"metadata_alloc": MetadataAllocRole(), "metadata_free": MetadataFreeRole()}
