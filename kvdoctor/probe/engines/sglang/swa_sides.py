"""SGLang's sliding-window pool (`SWATokenToKVPoolAllocator`) judged as one pool of two sides.

The composite hands out a full slot and an SWA slot together (`full_attn_allocator`,
`swa_attn_allocator`, two token allocators the map hooks) and pairs them in
`full_to_swa_index_mapping`. A request's row and the tree's FULL component hold full slots; the
tree's SWA component holds SWA slots (a node whose SWA side was evicted, a tombstone, holds none);
a running request's SWA slots are reached through the mapping, and those that left its window are
freed while it runs (`free_swa_out_of_window_slots`).

- The full side is a classic ledger: the composite's tree and its request rows are the full part's
  (`state.ledger_for` and the coverage judge take the full part for the composite).
- The SWA side's ledger sees every allocation and free of SWA slots. What holds them is read from
  SGLang at a census with no request live (the engine idle or exiting): the SWA slots of every
  tree node whose SWA side is resident (SGLang's own walk of its tree, `walk_for_kv_canary`, on
  its Python or Rust tree core, through the mapping) become the ledger's tree pages, and pages the
  ledger held as the tree's that it no longer holds are held by no one. The census holds that to
  SGLang's own counts (the SWA free list against the ledger, the tree's SWA slots read against its
  `swa_evictable_size() + swa_protected_size()`) and names nothing where they differ; a census with
  requests live leaves the tree pages as they were and, short of SGLang's count, says so.
- At a request's release (judged where the state judges it: after its free group's frees are in),
  a full slot of its row that was freed while the mapping still pairs it with an SWA slot the SWA
  ledger holds allocated is an SWA free that never came: named with the request, the slot pairs and
  the SWA slot's allocation site.
- A rolling census cannot tell an SWA slot of a running request from a leaked one (no row names
  SWA slots): none is taken for the SWA side.

Proven on host pools at page size 1 (the CPU server's): a mapping on a device, a paged SWA pool or
a per-request SWA ring is not judged, and the coverage line says why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvdoctor.probe.base.objects import own
from kvdoctor.probe.base.vocabulary import FREE, OWNED, TREE
from kvdoctor.probe.engines.sglang import coverage
from kvdoctor.probe.ledgers.busy import _leaked
from kvdoctor.probe.ledgers.requests import RELEASED

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext
    from kvdoctor.probe.ledgers.slots import SlotLedger

SWA_CLASS = "SWATokenToKVPoolAllocator"
SWA_PART = "swa"
ROLLING_BLIND = (
    "a rolling census does not judge the SWA side: a running request's SWA slots are reached through "
    "full_to_swa_index_mapping, not its row, and are read only at an idle or exit census"
)


def parts(allocator: Any) -> tuple[Any, Any] | None:
    """(full, swa) of an SWA composite of the exact class this module follows, else None."""
    if allocator is None or type(allocator).__name__ != SWA_CLASS:
        return None
    full, swa = own(allocator, "full_attn_allocator"), own(allocator, "swa_attn_allocator")
    if full is None or swa is None or full is swa:
        return None
    return full, swa


def full_side(allocator: Any) -> Any:
    """The allocator whose ledger holds `allocator`'s full slots: an SWA composite's full part."""
    found = parts(allocator)
    return found[0] if found is not None else allocator


def may_be_primary(name: str) -> bool:
    """Request rows name full slots: the ledger of an SWA part is never the one they are written to."""
    return f"/{SWA_PART}/" not in f"/{name}"


def composite_in_callers(allocator: Any) -> Any:
    """The SWA composite whose call reached `allocator` (it, or an engine object naming it, is a
    caller's `self`), or None."""
    for _, obj in coverage.caller_selves():
        for holder in (obj, own(obj, "token_to_kv_pool_allocator")):
            found = parts(holder)
            if found is not None and any(p is allocator for p in found):
                return holder
    return None


def standing(composite: Any) -> str:
    """'' when this module judges both sides of `composite`, else why not."""
    mapping = own(composite, "full_to_swa_index_mapping")
    device = getattr(mapping, "device", None)
    if device is None:
        return f"{SWA_CLASS} has no full_to_swa_index_mapping tensor"
    if getattr(device, "type", "") != "cpu":
        return f"the full-to-SWA mapping lives on {device}; the SWA side is proven on host pools only"
    if own(composite, "page_size") != 1:
        return "the SWA side is proven at page size 1 only (a paged SWA pool frees whole pages through the mapping)"
    if own(composite, "_swa_req_ring"):
        return "a per-request SWA ring: its SWA slots are owned by request rows, not handed out by the SWA allocator"
    return ""


class SwaSide:
    """One composite and its two parts' ledgers (either None until made)."""

    def __init__(self, composite: Any) -> None:
        self.composite = composite
        self.full: SlotLedger | None = None
        self.swa: SlotLedger | None = None
        self.group_frees: list[Any] | None = None  # the full frees of the group now ending


class SwaSides:
    """Per process: the SWA composites met, by id."""

    def __init__(self, probe: Any = None) -> None:
        self.sides: dict[int, SwaSide] = {}

    def periodic(self, probe: Any) -> None:
        return None

    def close(self, probe: Any, reason: str) -> None:
        return None


LEDGER = "swa_sides"
MAX_COMPOSITES = 16


def sides(probe: ProbeContext) -> SwaSides:
    return probe.state(LEDGER, SwaSides)


def install(state: Any, composite: Any, ledger: SlotLedger, allocator: Any) -> bool:
    """`ledger` (of `allocator`, a part of `composite`) judged as its side; False past MAX_COMPOSITES."""
    registry = sides(state.probe)
    side = registry.sides.get(id(composite))
    if side is None:
        if len(registry.sides) >= MAX_COMPOSITES:
            return False
        side = registry.sides[id(composite)] = SwaSide(composite)
    full, swa = parts(composite) or (None, None)
    if allocator is full:
        side.full = ledger
    elif allocator is swa and side.swa is not ledger:
        side.swa = ledger
        from kvdoctor.probe.ledgers.busy import RollingCensus

        state.rolling[id(ledger)] = RollingCensus(ledger, state.rolling_interval_s, blind=ROLLING_BLIND)
    return True


def side_of(probe: ProbeContext, ledger: SlotLedger) -> SwaSide | None:
    """The side whose SWA part's ledger is `ledger`."""
    return next((s for s in sides(probe).sides.values() if s.swa is ledger), None)


def group_still_open(state: Any, ledger: SlotLedger) -> bool:
    """True while the primary's allocator still holds frees in an open group: an SWA composite ends
    its own group (its SWA frees) before its full part's, and releases wait for the full frees.
    Then the full slots that group frees are noted; at the full part's end, those freed while the
    mapping still pairs them with an SWA slot the SWA ledger holds are named (`group_ended`)."""
    allocator = state.hosts.get(id(ledger))
    if allocator is None or not _group_open(allocator, state.allocator_options(allocator)):
        for side in list(sides(state.probe).sides.values()):
            if side.full is ledger and side.group_frees is not None:
                frees, side.group_frees = side.group_frees, None
                state.emit_violations(group_ended(state, side, frees))
        return False
    for side in list(sides(state.probe).sides.values()):
        pending = own(allocator, "free_group")
        if side.full is ledger and isinstance(pending, list) and pending and side.swa is not None:
            side.group_frees = [t.clone() for t in pending if hasattr(t, "numel") and t.numel()]
    return True


def _group_open(allocator: Any, options: dict[str, Any]) -> bool:
    """As `state.group_open` (which this module may not import: the state imports it)."""
    attr = options.get("group_attr")
    value = getattr(allocator, attr, None) if attr else None
    return (value is False) if options.get("group_open_when") == "false" else (attr is not None and value is not None)


def group_ended(state: Any, side: SwaSide, frees: list[Any]) -> list[dict[str, Any]]:
    """The SWA slots a free group's full frees left behind, by the request whose row held each full slot."""
    if not frees or side.full is None or side.swa is None or side.full.not_judged or side.swa.not_judged:
        return []
    try:
        import torch

        full = np.asarray(torch.cat([t.reshape(-1) for t in frees]).cpu().numpy(), dtype=np.int64)
        rows = side.full.owner[np.clip(full, 0, side.full.num_pages + 1)]
        out = []
        for row in np.unique(rows[rows >= 0]):  # (a slot no row held is left to the census)
            rid = state.requests.live.get(int(row)) or state.requests.finished.get(int(row)) or "?"
            out += _judge_release(side, full[rows == row], int(row), rid)
        return out
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
        return []


def census_tree_sizes(state: Any, ledger: SlotLedger) -> dict[str, int] | None:
    """For an SWA side's ledger, just before its census: with no request live (the engine idle or
    exiting, no call in flight), the tree's SWA holdings made the ledger's tree pages; and SGLang's
    own SWA counts for the census to hold them to (a census with requests live, or a tree that
    cannot be read, then finds the ledger's tree pages short of them and says it cannot judge).
    None for any other ledger."""
    side = side_of(state.probe, ledger)
    if side is None:
        return None
    tree = state.tree
    if tree is None or own(tree, "token_to_kv_pool_allocator") is not side.composite:
        return {"tree_evictable_slots": 0, "tree_protected_slots": 0}
    try:
        sizes = {"tree_evictable_slots": int(tree.swa_evictable_size()), "tree_protected_slots": int(tree.swa_protected_size())}
    except Exception:
        return None  # the census holds the ledger to the FULL side's counts, which its SWA pages fall short of
    if not state.requests.idle:
        return sizes
    try:
        pages = tree_swa_pages(tree, side.composite, ledger.page_size, ledger.num_pages)
    except Exception:  # the tree changed while read
        pages = None
    with ledger.lock:
        mark_tree(ledger, pages if pages is not None else np.zeros(0, dtype=np.int64))
    sizes["swa_tree_read_slots"] = -1 if pages is None else int(pages.size) * ledger.page_size
    return sizes


def mark_tree(ledger: SlotLedger, pages: np.ndarray) -> None:
    """The pages the tree's SWA component holds now are the ledger's tree pages; its tree pages the
    tree no longer holds are held by no one if allocated, free if freed. A page on the free list the
    tree holds is left free: the census's books then disagree and it says so."""
    state = ledger.state
    held = np.zeros(ledger.num_pages + 2, dtype=np.bool_)
    held[pages] = True
    held[0] = held[ledger.sink] = False
    was_tree = (state & TREE) != 0
    gone = was_tree & ~held
    state[gone & ((state & FREE) != 0)] = FREE
    lost = gone & ((state & FREE) == 0)
    state[lost] = OWNED
    ledger.owner[lost] = -1
    taken = held & ((state == OWNED) | (state == TREE))
    state[taken] = TREE
    ledger.owner[taken] = -1


def tree_swa_pages(tree: Any, composite: Any, page_size: int, num_pages: int) -> np.ndarray | None:
    """The distinct SWA pages the tree's SWA component holds, None where they cannot be read. Read
    through SGLang's own walk of its tree (`walk_for_kv_canary`, both its Python and its Rust tree
    core): the full slots of every node whose SWA side is resident, which the composite's mapping
    pairs with that node's SWA slots (a tombstone's are not listed)."""
    walk = getattr(getattr(tree, "tree_core", None), "walk_for_kv_canary", None)
    mapping = own(composite, "full_to_swa_index_mapping")
    if walk is None or mapping is None:
        return None
    full = np.asarray(walk(False, True).slot_indices.detach().cpu().numpy(), dtype=np.int64).reshape(-1)
    if full.size and (full.min() <= 0 or full.max() >= mapping.shape[0] - 1):
        return None
    slots = mapping.detach().cpu().numpy()[full].astype(np.int64)
    if slots.size and (slots.min() <= 0 or np.unique(slots).size != slots.size):
        return None  # a resident node's full slot paired with no SWA slot, or one SWA slot twice: not the tree this reads
    pages = slots // page_size
    return np.unique(pages[(pages > 0) & (pages <= num_pages)])


def released(state: Any, ledger: SlotLedger, slots: Any, row: int, rid: str) -> list[dict[str, Any]]:
    """At a request's release, once the frees of its group are in: the SWA slots its full slots
    still map to although those full slots were freed, that the SWA ledger holds allocated: an SWA
    free that never came (a full slot the tree keeps is not free, and SGLang clears the mapping of
    every full slot whose SWA peer it frees). Host pools only."""
    for side in list(sides(state.probe).sides.values()):
        if side.full is not ledger or side.swa is None or ledger.not_judged or side.swa.not_judged:
            continue
        try:
            return _judge_release(side, slots, row, rid)
        except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
            return []
    return []


def _judge_release(side: SwaSide, slots: Any, row: int, rid: str) -> list[dict[str, Any]]:
    mapping = own(side.composite, "full_to_swa_index_mapping")
    if mapping is None or getattr(mapping.device, "type", "") != "cpu" or side.full is None or side.swa is None:
        return []
    full = np.asarray(slots.detach().cpu().numpy() if hasattr(slots, "detach") else slots, dtype=np.int64).reshape(-1)
    full = np.unique(full[(full > 0) & (full <= side.full.num_pages)])
    if not full.size:
        return []
    peers = mapping.numpy()[full].astype(np.int64)
    keep = (peers > 0) & (peers <= side.swa.num_pages)
    full, peers = full[keep], peers[keep]
    freed = (side.full.state[full] & FREE) != 0  # (a tree bit left on it does not hold its SWA peer: the tree frees none)
    with side.swa.lock:
        held = side.swa.state[peers] == OWNED
        lost = freed & held & (side.swa.owner[peers] != RELEASED)
        if not lost.any():
            return []
        pages = np.unique(peers[lost])
        args = _leaked(side.swa, pages, row, rid)
    args["full_slot_ids"] = [int(f) for f in full[lost][:64]]
    args["note"] = (
        "SWA slots still allocated once the request's frees were in: their full slots were freed while "
        "full_to_swa_index_mapping still paired them (the SWA side's free never came)"
    )
    return [args]
