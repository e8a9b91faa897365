"""SGLang's sliding-window pool (`SWATokenToKVPoolAllocator`): a full-pool slot maps to its SWA slot
through `full_to_swa_index_mapping`, and freeing the SWA side of full slots frees the SWA slots they
map to. Inside a free group (the scheduler opens one around each batch's results) a release may defer
that free and read the mapping only when the group ends. SGLang 0.5.18's `free_swa` does
(sglang#36081): a tombstone recovery later in the same group (`RecoverSWAWithLockedFull`, an insert
over a node whose SWA side went while a running request holds its full side) points the node's full
slots at the incoming request's SWA slots, and the group's end frees those live slots, while the
SWA slots the free asked for are freed by nothing. 0.5.19 reads the mapping at the call.

At each free the allocator defers unresolved (its full slots appended to the allocator's
`free_group` or `swa_free_group`) the ledger keeps the SWA slots the full slots map to then: what
the free asks for. When the group's end runs a deferred list (the allocator's own `free`/`free_swa`
on its concatenated full slots, the group closed), a full slot whose mapping moved to another SWA
slot since is one whose free will take a slot nobody asked to free; after the call, such a slot
found in the SWA allocator's free list, and not in it before, is named: the SWA slot freed while
live, the full slot that mapped to it, the slot the free had asked for, the free's call site, and
the site and request of the insert that re-pointed the mapping (`set_full_to_swa_mapping`, the
request read from its callers' frames). A free resolved at the call (0.5.19's `free_swa`, every
free of 0.5.20 on) is not kept: nothing of it waits.

Reads: the mapping at the freed full slots (a host tensor), and the SWA allocator's free list only
when a mapping moved. A mapping on a device is not read (that would synchronise), nor a subclass
with free paths of its own: the ledger says it is off. Deferred frees are kept per group, at most
MAX_PENDING slots; past that the ledger says so and turns off.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.base.rank import ledger_name
from kvdoctor.probe.engines.sglang.state import group_open
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

LEDGER = "swa"
POOL_CLASS = "SWATokenToKVPoolAllocator"
MAX_PENDING = 1 << 20  # full slots of deferred frees kept for one group
MAX_POOLS = 16
MAX_REMAPS = 1024  # re-pointing calls remembered for one group
MAX_FRAMES = 64
NAMED = 64  # slots listed in one finding
DEFERRED = ("free_group", "swa_free_group")  # the allocator's lists of full slots whose free waits for the group's end


class NotJudged(Exception):
    """The pool is not one this ledger proves it sees."""


class Pending:
    """One allocator's deferred frees in the group now open (or just closed): per deferred list of the
    allocator, the full slots of each free, the SWA slots they mapped to at the call, and the call
    site; and the re-pointing calls that hit those full slots since."""

    def __init__(self, group: list[Any]) -> None:
        self.group = group  # the allocator's own free_group list: a new one at each group's begin
        self.frees: dict[str, list[tuple[Any, Any, int]]] = {}  # deferred list -> (full, asked, site)
        self.slots = 0
        self.remaps: list[tuple[Any, int, str]] = []


class SwaPoolLedger:
    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.pools: dict[int, Pending] = {}
        self.names: dict[int, str] = {}

    def periodic(self, probe: ProbeContext) -> None:
        return None  # judged on the scheduler's thread, at the calls

    def close(self, probe: ProbeContext, reason: str) -> None:
        return None

    def name(self, pool: Any) -> str:
        key = id(pool)
        if key not in self.names and len(self.names) < MAX_POOLS:
            self.names[key] = ledger_name(POOL_CLASS, len(self.names))
        return self.names.get(key, POOL_CLASS)


def state(probe: ProbeContext) -> SwaPoolLedger:
    return probe.state(LEDGER, SwaPoolLedger)


def turn_off(probe: ProbeContext, exc: Exception) -> None:
    probe.turn_off_ledger(LEDGER, "the SWA pool ledger", f"SWA slots not judged: {exc}")


def mapping_of(pool: Any) -> Any:
    """The pool's full-to-SWA mapping, read only where it is a host tensor of this exact class."""
    if type(pool).__name__ != POOL_CLASS:
        raise NotJudged(f"{type(pool).__name__} derives from {POOL_CLASS} with free paths of its own, which this ledger does not follow")
    mapping = getattr(pool, "full_to_swa_index_mapping", None)
    device = getattr(mapping, "device", None)
    if device is None:
        raise NotJudged(f"{POOL_CLASS} has no full_to_swa_index_mapping tensor")
    if getattr(device, "type", "") != "cpu":
        raise NotJudged(f"the full-to-SWA mapping lives on {device}; reading it would synchronise")
    return mapping


def free_units(pool: Any, units: Any) -> Any:
    """Which of `units` (slots, or pages of a paged SWA allocator) are in the SWA allocator's free list."""
    import torch

    swa = getattr(pool, "swa_attn_allocator", None)
    lists = [t for t in (getattr(swa, "free_pages", None), getattr(swa, "release_pages", None)) if isinstance(t, torch.Tensor)]
    if len(lists) != 2:
        raise NotJudged(f"{type(swa).__name__}'s free list is not the free_pages/release_pages tensors it was")
    return torch.isin(units, torch.cat([t.to(torch.int64) for t in lists]))


def request_in_frames() -> str:
    """The rid of the nearest caller with a request in hand (a local `req`), or ''."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return ""
        if "req" in frame.f_code.co_varnames:
            rid = getattr(frame.f_locals.get("req"), "rid", None)
            if isinstance(rid, str):
                return rid
        frame = frame.f_back
    return ""


class SwaFreeRole(Role):
    """`SWATokenToKVPoolAllocator.free` / `free_swa(free_index)`: in an open group, what the free asks
    for is kept until the group's end; with the group closed, a call that runs a group's deferred
    frees is checked against what they asked for."""

    ledger = LEDGER
    wants_site = True
    reads = {"free_index": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        # free -> free_swa on one pool: the wrappers run a role once per object, the outer call
        try:
            return self.plan(probe, state(probe), hook, obj, hook.arg(args, kwargs, "free_index"), site)
        except (NotJudged, AttributeError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            turn_off(probe, exc)
            return None

    def plan(self, probe: ProbeContext, swa: SwaPoolLedger, hook: Hook, obj: Any, index: Any, site: int) -> Any:
        if index is None or not hasattr(index, "numel") or index.numel() == 0:
            return None
        if group_open(obj, hook.options):
            mapping = mapping_of(obj)
            group = getattr(obj, "free_group", None)
            if not isinstance(group, list):
                raise NotJudged(f"{POOL_CLASS}.free_group is {type(group).__name__} while a group is open (a list was expected)")
            lengths = {name: len(found) for name in DEFERRED for found in [getattr(obj, name, None)] if isinstance(found, list)}
            full = index.to(mapping.dtype).clone()
            return ("defer", group, full, mapping[full].clone(), site, lengths)
        pending = swa.pools.get(id(obj))
        if pending is None or not pending.frees:
            return None
        return self.flush_plan(swa, obj, index, site, pending)

    def flush_plan(self, swa: SwaPoolLedger, obj: Any, index: Any, site: int, pending: Pending) -> Any:
        """The SWA slots this call will free that its deferred frees did not ask for, if it is the call
        that runs them (its full slots are those of one of the allocator's deferred lists, in order)."""
        import torch

        for where, waiting in list(pending.frees.items()):
            full = torch.cat([e[0] for e in waiting])
            if index.numel() == full.numel() and torch.equal(index.to(full.dtype), full):
                entries = pending.frees.pop(where)
                break
        else:
            return None  # not a group's end running deferred frees: nothing to hold it to
        if not pending.frees:
            swa.pools.pop(id(obj), None)
        asked_all = torch.cat([e[1] for e in entries])
        now = mapping_of(obj)[full]
        moved = (now != asked_all) & (now > 0)
        if not bool(moved.any()):
            return None
        at = torch.repeat_interleave(torch.arange(len(entries)), torch.tensor([e[0].numel() for e in entries]))[moved]
        full, asked, now = full[moved], asked_all[moved], now[moved]
        unasked = ~torch.isin(now, asked_all[asked_all > 0])
        page = max(1, int(getattr(obj, "page_size", 1) or 1))
        units = now // page
        live = unasked & ~free_units(obj, units)
        if not bool(live.any()):
            return None
        sites = [entries[i][2] for i in at[live].tolist()]
        return ("flush", full[live], asked[live], now[live], units[live], sites, site, pending.remaps)

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if ctx is None or not probe.ledger_is_on(LEDGER):
            return
        try:
            if ctx[0] == "defer":
                self.keep(probe, hook, obj, ctx)
            else:
                self.judge(probe, hook, obj, ctx)
        except (NotJudged, AttributeError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            turn_off(probe, exc)

    def keep(self, probe: ProbeContext, hook: Hook, obj: Any, work: Any) -> None:
        """A free the allocator deferred unresolved (its full slots appended to one of its deferred
        lists, the mapping left to be read at the group's end) is kept; one it resolved is not."""
        import torch

        _, group, full, asked, site, lengths = work
        if not torch.equal(obj.full_to_swa_index_mapping[full], asked):
            return  # the call read and cleared the mapping: resolved
        for where, length in lengths.items():
            found = getattr(obj, where, None)
            if isinstance(found, list) and len(found) == length + 1 and torch.equal(found[-1].to(full.dtype), full):
                break
        else:
            return
        swa = state(probe)
        pending = swa.pools.get(id(obj))
        if pending is None or pending.group is not group:
            if pending is None and len(swa.pools) >= MAX_POOLS:
                raise NotJudged(f"more than {MAX_POOLS} SWA pools in one process")
            pending = swa.pools[id(obj)] = Pending(group)  # a new group: the last one's frees have run
        if pending.slots + full.numel() > MAX_PENDING:
            raise NotJudged(f"a free group deferred more than {MAX_PENDING} full slots")
        pending.slots += full.numel()
        pending.frees.setdefault(where, []).append((full, asked, site))

    def judge(self, probe: ProbeContext, hook: Hook, obj: Any, work: Any) -> None:
        """The live SWA slots this call freed although no deferred free asked for them."""
        _, full, asked, now, units, sites, flush_site, remaps = work
        freed = free_units(obj, units)
        if not bool(freed.any()):
            return
        swa = state(probe)
        by_site: dict[int, list[int]] = {}
        for position, site in enumerate(sites):
            if bool(freed[position]):
                by_site.setdefault(site, []).append(position)
        for site, positions in by_site.items():
            fulls = [int(full[p]) for p in positions]
            remap_site, requests = remapped_by(remaps, fulls)
            lost = [int(asked[p]) for p in positions if int(asked[p]) > 0]
            probe.emitter.emit(
                schema.VIOLATION,
                {
                    "kind": schema.SWA_SLOT_FREED_LIVE,
                    "count": len(positions),
                    "allocator": swa.name(obj),
                    "site": probe.sites.name(site),
                    "slot_ids": [int(now[p]) for p in positions][:NAMED],
                    "full_slot_ids": fulls[:NAMED],
                    "asked_slot_ids": lost[:NAMED],
                    "path": f"{POOL_CLASS}.{hook.method} deferred in a free group, run by its end at {probe.sites.name(flush_site)}",
                    "remapped_at": probe.sites.name(remap_site) if remap_site else "",
                    "requests": requests,
                    "page_size": max(1, int(getattr(obj, "page_size", 1) or 1)),
                },
            )


def remapped_by(remaps: list[tuple[Any, int, str]], fulls: list[int]) -> tuple[int, dict[str, int]]:
    """The last seen call that re-pointed any of `fulls`, and the requests whose calls re-pointed them."""
    import torch

    site, requests = 0, dict[str, int]()
    wanted = torch.tensor(fulls)
    for slots, at, rid in remaps:
        hit = int(torch.isin(slots, wanted).sum())
        if hit:
            site = at
            if rid:
                requests[rid] = requests.get(rid, 0) + hit
    return site, requests


class SwaRemapRole(Role):
    """`SWATokenToKVPoolAllocator.set_full_to_swa_mapping(full_indices, swa_indices)`: a call that
    re-points a full slot with a deferred free is remembered, with its site and request."""

    ledger = LEDGER
    wants_site = True
    reads = {"full_indices": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        pending = state(probe).pools.get(id(obj))
        full = hook.arg(args, kwargs, "full_indices")
        if pending is None or full is None or not hasattr(full, "numel") or len(pending.remaps) >= MAX_REMAPS:
            return
        try:
            import torch

            waiting = [e[0] for entries in pending.frees.values() for e in entries]
            if not waiting or getattr(full, "device", None) is None or full.device.type != "cpu":
                return
            full = full.to(torch.int64)
            hit = full[torch.isin(full, torch.cat(waiting).to(torch.int64))]
            if hit.numel():
                pending.remaps.append((hit.clone(), ctx, request_in_frames()))
        except (AttributeError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            turn_off(probe, exc)


ROLES: dict[str, Role] = {"swa_free": SwaFreeRole(), "swa_remap": SwaRemapRole()}
