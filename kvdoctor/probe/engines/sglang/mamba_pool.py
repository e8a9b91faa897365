"""SGLang's Mamba state slots (`HybridReqToTokenPool.mamba_pool`, a `MambaPool`): every slot is free,
held by the radix tree, held by a request's row, or held by a live request; anything else is an
orphan, named with the request that last held it and the path that took it.

With `MambaRadixCache`, `Req.init_next_round_input` -> `match_prefix` copies a cached state into a
fresh slot for the request (copy-on-write) before `PrefillAdder.add_one_req` decides whether the
request runs. Up to 0.5.9, a request refused there (NO_TOKEN) goes back to the waiting queue still
holding that slot (sglang#15840; 0.5.10's scheduler frees it at the refusal, sglang PR#16067). Such a
waiting request is a holder, not a leak (SGLang's own idle check counted it as one: the sglang#12432
/ #20010 class); the slot is orphaned once the request leaves the queue without giving it back, as
`_abort_on_waiting_timeout` and `_abort_on_queued_limit` do in those releases.

After a hooked `Scheduler.get_new_batch_prefill` (at most once a second: the scheduler calls it at
every step) the ledger takes a census of the pool: free
slots (the pool's free list), the tree's (every node's `mamba_value`), the rows' (the request pool's
mapping, for rows in use) and the live requests' (`mamba_pool_idx` of the waiting queue, running
batch, chunked and last batch). Slot numbers are read only from host tensors: a pool whose free list
lives on a GPU is not judged (reading it would synchronise), and a scheduler laid out otherwise (PD
disaggregation, pipeline stages, HiCache, a tree without nodes) turns the ledger off; both are said
in one `probe_status` line. The KV slot ledger cannot see the KV slots a `MambaRadixCache` holds (its
inserts are not a `RadixCache`'s): these hooks tell it, and it names no KV orphan beside this tree.
A slot is named after two censuses in a row found it unaccounted, so a request between two of the
scheduler's lists is never named.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.base.emitter import say
from kvdoctor.probe.base.settings import DAY_S, env_number
from kvdoctor.probe.engines.sglang.state import sglang_state
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

LEDGER = "mamba"
MAX_SLOTS = 1 << 16  # a larger pool is not read at every prefill pick
MAX_NODES = 1 << 17  # tree nodes walked at one census
CENSUSES_TO_NAME = 2  # consecutive censuses a slot must be unaccounted before it is named
# The scheduler calls get_new_batch_prefill at every step of its loop; a census reads the whole pool,
# the tree and the rows, so it runs at most this often on the scheduler's thread.
CENSUS_PERIOD_S = 1.0
COW_PATH = "MambaRadixCache.match_prefix (copy-on-write)"
KV_NOT_JUDGED = "its slots are also held by a MambaRadixCache, whose inserts and evictions the probe map does not hook as a radix tree's"
REFUSED = " kept through PrefillAdder.add_one_req -> {result} (the request went back to the waiting queue)"


class NotJudged(Exception):
    """The pool or scheduler is not one this ledger proves it sees."""


def host_slots(value: Any) -> list[int]:
    """A slot index (a tensor, an int or a list of them) as ints; NotJudged for a device tensor."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    device = getattr(value, "device", None)
    if device is None:
        return [int(v) for v in value]
    if getattr(device, "type", "") != "cpu":
        raise NotJudged(f"the Mamba pool's slot numbers live on {device}; reading them would synchronise")
    return [int(v) for v in value.reshape(-1).tolist()]


class MambaSlotLedger:
    """Per process: who took each slot and how (bounded by the pool's size), the censuses each
    unaccounted slot has been seen in, the slots already named, and the last count said."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.taken: dict[int, tuple[str, str, int]] = {}  # slot -> (rid, path, site)
        self.unaccounted: dict[int, int] = {}
        self.named: set[int] = set()
        self.said: tuple[int, ...] | None = None
        self.kv_told: set[int] = set()  # KV allocators whose ledger was told it cannot see this tree
        self.period_s = _census_period()
        self.last_census = float("-inf")

    def census_due(self) -> bool:
        now = time.monotonic()
        if now - self.last_census < self.period_s:
            return False
        self.last_census = now
        return True

    def periodic(self, probe: ProbeContext) -> None:
        return None  # counted on the scheduler's thread after each prefill pick, not from here

    def close(self, probe: ProbeContext, reason: str) -> None:
        return None  # the census needs the scheduler, met only in its own calls

    def note_taken(self, slot: int, rid: str, path: str, site: int) -> None:
        if slot in self.taken or len(self.taken) < MAX_SLOTS:
            self.taken[slot] = (rid, path, site)

    def census(self, probe: ProbeContext, scheduler: Any, picked: Any = None) -> None:
        pool, tree = scheduler.req_to_token_pool, scheduler.tree_cache
        mamba = getattr(pool, "mamba_pool", None)
        size = getattr(mamba, "size", None)
        if mamba is None or not isinstance(size, int):
            raise NotJudged(f"{type(pool).__name__} has no Mamba pool with a size")
        if size > MAX_SLOTS:
            raise NotJudged(f"the Mamba pool has {size} slots (more than {MAX_SLOTS})")
        unlike = [
            what
            for what, off in (
                ("PD disaggregation", str(getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")) != "null"),
                ("pipeline stages", getattr(scheduler, "pp_size", 1) != 1),
                ("HiCache", bool(getattr(scheduler, "enable_hierarchical_cache", False))),
            )
            if off
        ]
        if unlike:
            raise NotJudged(f"the scheduler runs {', '.join(unlike)}, whose queues this ledger does not read")
        free = set(host_slots(mamba.free_slots))
        in_tree = tree_slots(tree)
        in_rows = row_slots(pool)
        waiting = list(getattr(scheduler, "waiting_queue", []))
        live = [
            *waiting,
            *batch_reqs(getattr(scheduler, "running_batch", None)),
            *batch_reqs(getattr(scheduler, "last_batch", None)),
            *batch_reqs(picked),
        ]
        chunked = getattr(scheduler, "chunked_req", None)
        if chunked is not None:
            live.append(chunked)
        held = {slot for req in live for slot in request_slots(req)}
        waiting_held = {slot for req in waiting for slot in request_slots(req)} - in_rows
        everything = free | in_tree | in_rows | held
        if everything and (min(everything) < 0 or max(everything) > size):
            raise NotJudged(f"slot {max(everything)} is outside the Mamba pool's {size} slots")
        orphans = [slot for slot in range(1, size + 1) if slot not in everything]
        self.unaccounted = {slot: self.unaccounted.get(slot, 0) + 1 for slot in orphans}
        self.named &= set(orphans)
        for slot in list(self.taken):
            if slot in free:
                del self.taken[slot]
        count = (size, len(free), len(in_tree), len(in_rows), len(waiting_held), len(held), len(orphans))
        if count != self.said:
            self.said = count
            probe.emitter.emit(
                schema.MAMBA_POOL,
                dict(
                    zip(("slots", "free", "tree", "request_rows", "waiting_holders", "request_holders", "unaccounted"), count, strict=True)
                ),
            )
        due = [slot for slot in orphans if self.unaccounted[slot] >= CENSUSES_TO_NAME and slot not in self.named]
        if due:
            self.name_orphans(probe, due, size)

    def name_orphans(self, probe: ProbeContext, slots: list[int], size: int) -> None:
        by_path: dict[tuple[str, int], list[int]] = {}
        for slot in slots:
            self.named.add(slot)
            _, path, site = self.taken.get(slot, ("", "a path the probe did not see", 0))
            by_path.setdefault((path, site), []).append(slot)
        emit_orphans(probe, by_path, lambda slot: self.taken.get(slot, (UNKNOWN_TAKER, "", 0))[0], size)


UNKNOWN_TAKER = "unknown (taken before the probe watched)"


def emit_orphans(probe: ProbeContext, groups: dict[tuple[str, int], list[int]], rid_of: Any, size: int, **extra: Any) -> None:
    """One `mamba_orphan_slots` violation per (path, site) group of orphaned slots, with the
    requests that took them (`rid_of(slot)`)."""
    for (path, site), group in groups.items():
        requests: dict[str, int] = {}
        for slot in group:
            rid = str(rid_of(slot))
            requests[rid] = requests.get(rid, 0) + 1
        args = {"kind": schema.MAMBA_ORPHAN_SLOTS, "count": len(group), "allocator": "MambaPool"}
        args.update({"site": probe.sites.name(site) if site else "unknown", "slot_ids": group[:64], "requests": requests})
        probe.emitter.emit(schema.VIOLATION, {**args, "path": path, "pool_slots": size, **extra})


def _census_period() -> float:
    """CENSUS_PERIOD_S, or KVDOCTOR_MAMBA_CENSUS_PERIOD_S where set (0: at every pick, as tests drive it)."""
    return env_number("KVDOCTOR_MAMBA_CENSUS_PERIOD_S", CENSUS_PERIOD_S, high=DAY_S)


def tree_slots(tree: Any) -> set[int]:
    root = getattr(tree, "root_node", None)
    if root is None:
        raise NotJudged(f"{type(tree).__name__} has no root_node to read the Mamba states it holds from")
    out: set[int] = set()
    stack, seen = [root], 0
    while stack:
        node = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise NotJudged(f"the tree has more than {MAX_NODES} nodes")
        out.update(host_slots(getattr(node, "mamba_value", None)))
        stack.extend(getattr(node, "children", {}).values())
    return out


def row_slots(pool: Any) -> set[int]:
    """The Mamba slots of the request pool's rows in use (main state and, with the extra buffer, its
    ping-pong slots)."""
    free_rows = getattr(pool, "free_slots", None)
    mapping = getattr(pool, "req_index_to_mamba_index_mapping", None)
    if not isinstance(free_rows, list) or mapping is None:
        raise NotJudged(f"{type(pool).__name__}'s free rows or its Mamba mapping are not laid out as 0.5.9's")
    rows = sorted(set(range(pool.size)) - set(free_rows))
    if not rows:
        return set()
    out = set(host_slots(mapping[rows]))
    extra = getattr(pool, "req_index_to_mamba_ping_pong_track_buffer_mapping", None)
    if getattr(pool, "enable_mamba_extra_buffer", False) and extra is not None:
        out.update(host_slots(extra[rows]))
    return out


def batch_reqs(batch: Any) -> list[Any]:
    reqs = getattr(batch, "reqs", None)
    return list(reqs) if isinstance(reqs, list) else []


def request_slots(req: Any) -> list[int]:
    return [*host_slots(getattr(req, "mamba_pool_idx", None)), *host_slots(getattr(req, "mamba_ping_pong_track_buffer", None))]


def tell_kv_ledger(probe: ProbeContext, tree: Any) -> None:
    """The KV slot ledger of the tree's allocator cannot see the KV slots a `MambaRadixCache` holds
    (it is not a `RadixCache`): it names no orphan from then on, and says why. Tried at each hooked
    call until that ledger exists (its first allocation), then never again."""
    allocator = getattr(tree, "token_to_kv_pool_allocator", None)
    mamba = state(probe)
    if allocator is None or id(allocator) in mamba.kv_told:
        return
    kv = sglang_state(probe)
    ledger = kv.ledgers.get(id(allocator))
    if ledger is None:
        return
    mamba.kv_told.add(id(allocator))
    if not ledger.not_judged:
        ledger.not_judged = KV_NOT_JUDGED
        say(f"{ledger.name}: orphans not judged: {KV_NOT_JUDGED}")
        kv.judging.judge_ledgers(force_report=True)


def match_request(hook: Hook, args: Args, kwargs: Kwargs) -> Any:
    """The request a `match_prefix` copies a state for: `params.req` (0.5.8 on), or the `req` keyword."""
    params = args[0] if args else kwargs.get("params")
    req = getattr(params, "req", None)
    return req if req is not None else kwargs.get("req")


def turn_off(probe: ProbeContext, exc: Exception) -> None:
    probe.turn_off_ledger(LEDGER, "the Mamba slot ledger", f"Mamba slots not judged: {exc}")


def state(probe: ProbeContext) -> MambaSlotLedger:
    return probe.state(LEDGER, MambaSlotLedger)


class MambaMatchRole(Role):
    """`MambaRadixCache.match_prefix`: a request that had no slot and has one now took it here."""

    ledger = LEDGER
    wants_site = True

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        tell_kv_ledger(probe, obj)
        req = match_request(hook, args, kwargs)
        return None if req is None or getattr(req, "mamba_pool_idx", None) is not None else (req, site)

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if ctx is None:
            return
        req, site = ctx
        try:
            for slot in host_slots(getattr(req, "mamba_pool_idx", None)):
                state(probe).note_taken(slot, str(getattr(req, "rid", "?")), COW_PATH, site)
        except NotJudged as exc:
            turn_off(probe, exc)


class MambaAdmitRole(Role):
    """`PrefillAdder.add_one_req(req, ...)`: a request it did not take that still holds a slot goes
    back to the waiting queue with it; the slot's path says so."""

    ledger = LEDGER
    reads = {"req": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        req = hook.arg(args, kwargs, "req")
        can_run = getattr(obj, "can_run_list", None)
        if req is None or not isinstance(can_run, list) or any(r is req for r in can_run):
            return
        try:
            slots = host_slots(getattr(req, "mamba_pool_idx", None))
        except NotJudged as exc:
            turn_off(probe, exc)
            return
        mamba = state(probe)
        for slot in slots:
            _, path, site = mamba.taken.get(slot, ("", "a path the probe did not see", 0))
            if "add_one_req" not in path:
                path += REFUSED.format(result=getattr(result, "name", result))
            mamba.note_taken(slot, str(getattr(req, "rid", "?")), path, site)


class MambaCensusRole(Role):
    """`Scheduler.get_new_batch_prefill`: once the pick returned, every slot is accounted for."""

    ledger = LEDGER

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if not hasattr(getattr(obj, "req_to_token_pool", None), "mamba_pool"):
            return  # not a Mamba model: nothing to count
        if type(getattr(obj, "tree_cache", None)).__name__ == "MambaRadixCache":
            tell_kv_ledger(probe, obj.tree_cache)
        mamba = state(probe)
        if not mamba.census_due():
            return
        try:
            mamba.census(probe, obj, result)
        except NotJudged as exc:
            turn_off(probe, exc)
        except (AttributeError, TypeError, ValueError, IndexError) as exc:
            turn_off(probe, NotJudged(f"{type(exc).__name__}: {exc}"))


ROLES: dict[str, Role] = {"mamba_match": MambaMatchRole(), "mamba_admit": MambaAdmitRole(), "mamba_census": MambaCensusRole()}
