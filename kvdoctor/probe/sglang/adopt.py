"""Adopting an allocator's state when the probe meets it already in use (attach, late activation).

A ledger that starts "every slot free" on a server that has been running would be wrong from its
first call, and blind to what leaked before: the reason a user attaches. So when the first hooked
call finds an allocator with slots already handed out, its state is read once, under the GIL, on
the scheduler's own thread (nothing moves meanwhile):

- free: the allocator's own free list;
- tree: every value the radix tree holds (`all_values_flatten`);
- owned: for each live request (the request objects found in the heap, by their row and
  allocated length), the slots its row points at;
- everything else was leaked before the probe arrived: named as orphans at the next census.

Live rows whose request object cannot be found are read whole (their row's entries count as
theirs), which can only hide a leak, never invent one; the status event says when that happened.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import numpy as np

from kvdoctor.probe.hooks import resolve
from kvdoctor.probe.ledger.requests import BEFORE_ATTACH
from kvdoctor.probe.ledger.slots import SlotLedger
from kvdoctor.probe.ledger.states import FREE, OWNED, RESERVED, TREE
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.sglang.state import SglangState

REQUEST_CLASS_SUFFIXES = ("Req", "Request")


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
    state: SglangState, ledger: SlotLedger, allocator: Any, free_pages: Any, tree_classes: set[str], index_attr: str
) -> dict[str, Any]:
    """Builds `ledger` from the allocator, tree and request pool as they are; returns what it found."""
    trees, pools, requests = _find_holders(allocator, tree_classes, index_attr)
    ps = ledger.page_size
    st = np.full(ledger.num_pages + 2, OWNED, dtype=np.int8)
    owner = np.full(ledger.num_pages + 2, BEFORE_ATTACH, dtype=np.int32)
    free = _pages(free_pages, ps, ledger, as_pages=True)
    st[free] = FREE
    tree_pages = np.unique(np.concatenate([_pages(_tree_values(t), ps, ledger) for t in trees] or [np.zeros(0, np.int64)]))
    st[tree_pages] = TREE
    owner[tree_pages] = -1
    live_rows: set[int] = set()
    read_whole = 0
    for pool in pools:
        table = pool.req_to_token
        rows = set(range(1, int(table.shape[0]))) - {int(r) for r in getattr(pool, "free_slots", [])}
        live_rows |= rows
        for row in sorted(rows):
            found = _request_of(requests.get(row, []), table[row], ps, ledger, st)
            if found is None:
                read_whole += 1
                found = ("?", int(table.shape[1]))
            rid, length = found
            pages = _pages(table[row, :length], ps, ledger)
            pages = pages[st[pages] == OWNED]
            owner[pages] = row
            state.requests.allocated(row, rid)
    st[0] = RESERVED
    st[ledger.sink] = RESERVED
    owner[0] = owner[ledger.sink] = -1
    unheld = (st == OWNED) & (owner == BEFORE_ATTACH)
    unheld[0] = unheld[ledger.sink] = False
    site = state.probe.sites.intern(("before-attach",), lambda: schema.SITE_BEFORE_ATTACH)
    with ledger.lock:
        ledger.state[:] = ledger.xp.cast(st, ledger.state)
        ledger.owner[:] = ledger.xp.cast(owner, ledger.owner)
        ledger.alloc_site[:] = ledger.xp.cast(np.where(unheld, site, 0).astype(np.int32), ledger.alloc_site)
    before = int(np.count_nonzero(unheld))
    return {
        "adopted": True,
        "free_slots": int(free.size) * ps,
        "tree_slots": int(tree_pages.size) * ps,
        "live_requests": len(live_rows),
        "rows_read_whole": read_whole,
        "held_by_no_one_slots": int(before) * ps,
        "trees": [type(t).__name__ for t in trees],
    }


def _request_of(
    candidates: list[tuple[str, int]], row_slots: Any, page_size: int, ledger: SlotLedger, st: np.ndarray
) -> tuple[str, int] | None:
    """The request in a row: of the request objects naming that row (another engine in the same
    process may have one too), the longest whose slots are all in use in this allocator."""
    best: tuple[str, int] | None = None
    for rid, length in candidates:
        if 0 < length <= row_slots.shape[0] and (best is None or length > best[1]):
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


def _tree_values(tree: Any) -> Any:
    try:
        return tree.all_values_flatten()
    except (RuntimeError, ValueError):  # an empty RadixCache: torch.cat of nothing
        return None


def _find_holders(allocator: Any, tree_classes: set[str], index_attr: str) -> tuple[list[Any], list[Any], dict[int, list[tuple[str, int]]]]:
    """The trees (of the map's tree classes) and request pools that use `allocator`, and row ->
    [(rid, allocated length)] of the request objects in the heap. Attributes are read only from
    objects of those classes (by name), so no other object's properties run."""
    length_attr = index_attr.rsplit(".", 1)[0] + ".kv_allocated_len" if "." in index_attr else "kv_allocated_len"
    trees: list[Any] = []
    requests: dict[int, list[tuple[str, int]]] = {}
    for obj in gc.get_objects():
        name = type(obj).__name__
        try:
            if name in tree_classes and getattr(obj, "token_to_kv_pool_allocator", None) is allocator:
                trees.append(obj)
            elif name.endswith(REQUEST_CLASS_SUFFIXES):
                row = resolve(obj, index_attr)
                length = resolve(obj, length_attr)
                if isinstance(row, int) and isinstance(length, int):
                    requests.setdefault(row, []).append((str(getattr(obj, "rid", "?")), length))
        except Exception:
            continue
    pools = list({id(p): p for p in (getattr(t, "req_to_token_pool", None) for t in trees) if p is not None}.values())
    return trees, pools, requests
