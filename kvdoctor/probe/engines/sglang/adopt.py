"""Adopting an allocator's state when the probe meets it already in use (attach, late activation).

A ledger that starts "every slot free" on a server that has been running would be wrong from its
first call, and blind to what leaked before: the reason a user attaches. So when the first hooked
call finds an allocator with slots already handed out, its state is read once, under the GIL, on
the scheduler's own thread (nothing moves meanwhile):

- free: the allocator's own free list (and the pages of a free group not yet given back);
- tree: every value each radix tree of the allocator holds (`all_values_flatten`);
- owned: for each live request (the request objects found, by their row and allocated length),
  the slots its row points at;
- everything else is held by no one.

The holders are found in the heap and from the engine's own objects (the callers' `self`, walked a
few references deep): SGLang freezes its heap after start-up (`gc.freeze`), and frozen objects, its
scheduler and radix tree among them, are not in `gc.get_objects()`.

Before anything is named "leaked before attach" the books are checked against SGLang's own
counters, the numbers its idle check uses: the free slots read must be `available_size()`, and the
slots read from the trees must be what the engine's `tree_cache` counts (`evictable_size()` +
`protected_size()`). Where they do not agree, or no engine object names its tree, the adoption is
unproven: the slots held by no one get an owner that is never judged, the status says why with the
numbers, and from then on only what the probe sees happen is judged. A false accusation costs more
than a missed leak.

Live rows whose request object cannot be found are read whole (their row's entries count as
theirs), which can only hide a leak, never invent one; the status event says when that happened.
"""

from __future__ import annotations

import collections
import gc
from typing import TYPE_CHECKING, Any

import numpy as np

from kvdoctor.probe.base import objects
from kvdoctor.probe.base.context import resolve
from kvdoctor.probe.base.emitter import say
from kvdoctor.probe.base.vocabulary import FREE, OWNED, RESERVED, TREE
from kvdoctor.probe.engines.sglang import coverage
from kvdoctor.probe.ledgers.requests import BEFORE_ATTACH, UNPROVEN
from kvdoctor.probe.ledgers.slots import SlotLedger
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.callsites import CallSites
    from kvdoctor.probe.ledgers.requests import RequestTable

REQUEST_CLASS_SUFFIXES = ("Req", "Request")
ALLOCATOR_ATTR = "token_to_kv_pool_allocator"
WALK_DEPTH = 4  # scheduler -> running_batch -> reqs -> Req; scheduler -> a disaggregation queue -> queue -> Req
MAX_WALKED = 50_000  # objects looked at from the engine's own objects (one pass, at adoption only)
# whose objects the walk does not enter: tensors, arrays, models, sockets, threads, loggers
SKIPPED_MODULE_PREFIXES = ("torch", "numpy", "transformers", "zmq", "threading", "asyncio", "logging", "multiprocessing", "kvdoctor")
ATOMIC_TYPES = (str, bytes, bytearray, int, float, complex, bool, type(None), type, memoryview, range)


def needs_adoption(ledger: SlotLedger, free_pages: Any) -> bool:
    """Slots were handed out before the probe saw this allocator (a fresh one has all pages free).

    Counted as distinct pages on a bitmap: a fresh pool's free list is every page once, and
    sorting or hashing it (`np.unique`) cost more than the rest of a ledger's setup together."""
    if free_pages is None:
        return False
    pages = np.asarray(free_pages).ravel()
    if pages.size < ledger.num_pages:
        return True
    if pages.dtype.kind not in "iu" or int(pages.min()) < 0 or int(pages.max()) > ledger.num_pages + 1:
        return len(np.unique(pages)) < ledger.num_pages  # not page numbers as we know them: count them all
    seen = np.zeros(ledger.num_pages + 2, dtype=np.bool_)
    seen[pages] = True
    return int(np.count_nonzero(seen)) < ledger.num_pages


def adopt(
    requests: RequestTable, sites: CallSites, ledger: SlotLedger, allocator: Any, free_pages: Any, tree_classes: set[str], index_attr: str
) -> dict[str, Any]:
    """Builds `ledger` from the allocator, trees and request pools as they are; returns what it
    found, the books and whether they add up (`verified`). The live requests found are entered in
    `requests` (the state's table), the adopted pages' site interned in `sites` (the probe's)."""
    found = find_holders(allocator, tree_classes, index_attr)
    ps = ledger.page_size
    st = np.full(ledger.num_pages + 2, OWNED, dtype=np.int8)
    owner = np.full(ledger.num_pages + 2, BEFORE_ATTACH, dtype=np.int32)
    free = _pages(free_pages, ps, ledger, as_pages=True)
    st[free] = FREE
    pending = _pages(_free_group(allocator), ps, ledger)  # freed inside an open free group: given back at its end
    pending = pending[st[pending] == OWNED]
    owner[pending] = UNPROVEN
    tree_values = [_tree_values(t) for t in found.trees]
    tree_tokens = sum(_length(v) for v in tree_values)
    tree_pages = np.unique(np.concatenate([_pages(v, ps, ledger) for v in tree_values] or [np.zeros(0, np.int64)]))
    free_in_tree = int(np.count_nonzero(st[tree_pages] == FREE))
    st[tree_pages] = np.where(st[tree_pages] == FREE, st[tree_pages], TREE)
    owner[tree_pages] = -1
    live_rows: set[int] = set()
    read_whole = 0
    for pool in found.pools:
        table = pool.req_to_token
        rows = set(range(1, int(table.shape[0]))) - {int(r) for r in getattr(pool, "free_slots", [])}
        live_rows |= rows
        for row in sorted(rows):
            request = _request_of(found.requests.get(row, []), table[row], ps, ledger, st)
            if request is None:
                read_whole += 1
                request = ("?", int(table.shape[1]))
            rid, length = request
            pages = _pages(table[row, :length], ps, ledger)
            pages = pages[(st[pages] == OWNED) & (owner[pages] != UNPROVEN)]
            owner[pages] = row
            requests.allocated(row, rid)
    st[0] = RESERVED
    st[ledger.sink] = RESERVED
    owner[0] = owner[ledger.sink] = -1
    unheld = (st == OWNED) & (owner == BEFORE_ATTACH)
    unheld[0] = unheld[ledger.sink] = False
    books = check_books(allocator, ledger, found, free=int(free.size), tree_tokens=tree_tokens, free_in_tree=free_in_tree)
    verified = not books["unproven_because"]
    if verified:
        site = sites.intern(("before-attach",), lambda: schema.SITE_BEFORE_ATTACH)
    else:
        owner[unheld] = UNPROVEN
        site = sites.intern(("held-at-attach",), lambda: schema.SITE_HELD_AT_ATTACH)
    with ledger.lock:
        ledger.state[:] = ledger.xp.cast(st, ledger.state)
        ledger.owner[:] = ledger.xp.cast(owner, ledger.owner)
        ledger.alloc_site[:] = ledger.xp.cast(np.where(unheld, site, 0).astype(np.int32), ledger.alloc_site)
    held_by_no_one = int(np.count_nonzero(unheld)) * ps
    return {
        "adopted": True,
        "verified": verified,
        "free_slots": int(free.size) * ps,
        "tree_slots": int(tree_pages.size) * ps,
        "live_requests": len(live_rows),
        "rows_read_whole": read_whole,
        "pending_free_slots": int(pending.size) * ps,
        "held_by_no_one_slots": held_by_no_one if verified else 0,
        "unproven_slots": 0 if verified else held_by_no_one + int(pending.size) * ps,
        "trees": [type(t).__name__ for t in found.trees],
        "engine_objects": sorted({type(h).__name__ for h in found.holders}),
        "books": books,
    }


class Holders:
    """What holds an allocator's slots, as found: its trees, request pools, live request objects
    (row -> [(rid, allocated length)]) and the engine objects that name it (scheduler, batch)."""

    def __init__(self) -> None:
        self.trees: list[Any] = []
        self.pools: list[Any] = []
        self.requests: dict[int, list[tuple[str, int]]] = {}
        self.holders: list[Any] = []
        self._seen_requests: set[int] = set()

    def add_tree(self, tree: Any) -> None:
        if all(t is not tree for t in self.trees):
            self.trees.append(tree)

    def add_holder(self, obj: Any) -> None:
        if all(h is not obj for h in self.holders):
            self.holders.append(obj)

    def add_request(self, obj: Any, index_attr: str, length_attr: str) -> None:
        if id(obj) in self._seen_requests:
            return
        self._seen_requests.add(id(obj))
        row = resolve(obj, index_attr)
        length = resolve(obj, length_attr)
        if isinstance(row, int) and isinstance(length, int):
            self.requests.setdefault(row, []).append((str(getattr(obj, "rid", "?")), length))


def find_holders(allocator: Any, tree_classes: set[str], index_attr: str) -> Holders:
    """The trees (of the map's tree classes) and request pools that use `allocator`, the request
    objects, and the engine objects naming it: from the heap the collector tracks, then from the
    callers' `self` and the engine objects found, a few references deep. Attributes are read only
    as instance attributes (no property runs), and requests only of classes named like requests."""
    length_attr = index_attr.rsplit(".", 1)[0] + ".kv_allocated_len" if "." in index_attr else "kv_allocated_len"
    out = Holders()

    def look_at(obj: Any) -> None:
        name = type(obj).__name__
        if objects.own(obj, ALLOCATOR_ATTR) is allocator:
            if name in tree_classes:
                out.add_tree(obj)
            else:
                out.add_holder(obj)
        elif name.endswith(REQUEST_CLASS_SUFFIXES) and objects.has_attributes(obj):
            out.add_request(obj, index_attr, length_attr)

    for obj in gc.get_objects():
        try:
            look_at(obj)
        except Exception:
            continue
    for obj in coverage.engine_callers(allocator):
        if objects.own(obj, ALLOCATOR_ATTR) is allocator:
            out.add_holder(obj)
    for obj in _walk([*out.holders, *out.trees]):
        try:
            look_at(obj)
        except Exception:
            continue
    pools = (objects.own(t, "req_to_token_pool") for t in [*out.trees, *out.holders])
    out.pools = list({id(p): p for p in pools if p is not None and hasattr(p, "req_to_token")}.values())
    return out


def check_books(allocator: Any, ledger: SlotLedger, found: Holders, *, free: int, tree_tokens: int, free_in_tree: int) -> dict[str, Any]:
    """What was read against SGLang's own counters; `unproven_because` is '' when they agree."""
    ps = ledger.page_size
    books: dict[str, Any] = {"pool_slots": ledger.num_pages * ps, "free_read_slots": free * ps, "tree_read_slots": tree_tokens}
    reasons: list[str] = []
    available = _call_int(allocator, "available_size")
    books["sglang_available_slots"] = available
    if available is None:
        reasons.append("the allocator's available_size() could not be read")
    elif available != free * ps:
        reasons.append(f"the allocator says {available} slots are free, its free list holds {free * ps} distinct ones")
    engine_trees = list({id(t): t for t in (objects.own(h, "tree_cache") for h in found.holders) if t is not None}.values())
    books["engine_trees"] = [type(t).__name__ for t in engine_trees]
    if not found.holders:
        reasons.append("no engine object (scheduler, batch) naming the allocator was found, so no tree can be ruled out")
    elif not engine_trees and found.trees:
        reasons.append("no engine object names its tree_cache")
    counted = 0
    for tree in [*engine_trees, *(t for t in found.trees if all(t is not e for e in engine_trees))]:
        evictable, protected = _call_int(tree, "evictable_size"), _call_int(tree, "protected_size")
        if evictable is None or protected is None:
            reasons.append(f"the {type(tree).__name__}'s evictable_size()/protected_size() could not be read")
            continue
        counted += evictable + protected
        if all(tree is not t for t in found.trees) and evictable + protected:
            reasons.append(
                f"the engine's tree_cache ({type(tree).__name__}, not a tree class the probe map names) holds {evictable + protected} slots"
            )
    books["sglang_tree_slots"] = counted
    if counted != tree_tokens:
        reasons.append(
            f"the engine's trees count {counted} slots (evictable + protected), kvdoctor read {tree_tokens} from the trees it found"
        )
    if free_in_tree:
        reasons.append(f"{free_in_tree * ps} slots are both in a tree and on the free list")
    books["unproven_because"] = "; ".join(dict.fromkeys(reasons))
    return books


def _walk(roots: list[Any]) -> list[Any]:
    """Objects reachable from `roots` through instance attributes and plain containers, breadth
    first, at most WALK_DEPTH references and MAX_WALKED objects; nothing of SKIPPED_MODULE_PREFIXES."""
    seen = {id(r) for r in roots}
    out: list[Any] = []
    queue = collections.deque((r, 0) for r in roots)
    while queue and len(seen) < MAX_WALKED:
        obj, depth = queue.popleft()
        if depth >= WALK_DEPTH:
            continue
        for child in _children(obj):
            if id(child) in seen or isinstance(child, ATOMIC_TYPES):
                continue
            if type(child).__module__.startswith(SKIPPED_MODULE_PREFIXES):
                continue
            seen.add(id(child))
            out.append(child)
            queue.append((child, depth + 1))
    return out


def _children(obj: Any) -> list[Any]:
    try:
        if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            return list(obj)
        if isinstance(obj, dict):
            return list(obj.values())
        return [value for _, value in objects.instance_items(obj)]
    except Exception:  # a container changed while read (another thread): skip it
        return []


def _call_int(obj: Any, method: str) -> int | None:
    try:
        value = getattr(obj, method)()
        return int(value)
    except Exception:
        return None


def _free_group(allocator: Any) -> Any:
    group = objects.own(allocator, "free_group")
    if not isinstance(group, list) or not group:
        return None
    try:
        import torch

        return torch.cat([g.reshape(-1) for g in group])
    except Exception:
        return None


def _request_of(
    candidates: list[tuple[str, int]], row_slots: Any, page_size: int, ledger: SlotLedger, st: np.ndarray
) -> tuple[str, int] | None:
    """The request in a row: of the request objects naming that row (another engine in the same
    process may have one too), the longest whose slots are all in use in this allocator."""
    best: tuple[str, int] | None = None
    for rid, length in candidates:
        if length == 0 and best is None:  # given its row, no slot yet
            best = (rid, 0)
        elif 0 < length <= row_slots.shape[0] and (best is None or length > best[1]):
            pages = _pages(row_slots[:length], page_size, ledger)
            if pages.size and not np.any(st[pages] == FREE):
                best = (rid, length)
    return best


def _pages(values: Any, page_size: int, ledger: SlotLedger, *, as_pages: bool = False) -> np.ndarray:
    if values is None:
        return np.zeros(0, dtype=np.int64)
    arr = np.asarray(values.detach().cpu().numpy() if hasattr(values, "detach") else values, dtype=np.int64).reshape(-1)
    pages = arr if as_pages else arr // page_size
    return np.unique(pages[(pages > 0) & (pages <= ledger.num_pages)])


def _length(values: Any) -> int:
    if values is None:
        return 0
    try:
        return int(values.numel()) if hasattr(values, "numel") else len(values)
    except Exception:
        return 0


def _tree_values(tree: Any) -> Any:
    try:
        return tree.all_values_flatten()
    except (RuntimeError, ValueError):  # an empty RadixCache: torch.cat of nothing
        return None


def host_free_pages(allocator: Any) -> Any:
    """The allocator's own free list (pages), for the census cross-check; None if unreadable."""
    if allocator is None:
        return None
    try:
        getter = getattr(allocator, "get_all_free_pages", None)
        if getter is not None:
            pages = getter()
        else:
            parts = [
                p
                for p in (getattr(allocator, "free_pages", None), getattr(allocator, "release_pages", None))
                if p is not None and p.numel() > 0
            ]
            if not parts:
                return []
            import torch

            pages = torch.cat(parts)
        if pages is None:
            return []
        return pages.detach().cpu().numpy()
    except Exception:
        return None


def say_unproven(probe: Any, name: str, found: dict[str, Any]) -> None:
    """An adoption whose books did not add up: said once, with the numbers, as a partial probe."""
    books = found["books"]
    reason = (
        f"the state of {name} adopted at attach is unproven: {books['unproven_because']}; the {found['unproven_slots']} "
        "slots held then by no holder kvdoctor found are not judged, and from now on only what the probe sees happen is"
    )
    probe.emitter.emit(
        schema.PROBE_STATUS, {"component": "adoption", "state": "partial", "allocator": name, "reason": reason, "books": books}
    )
    say(reason)
