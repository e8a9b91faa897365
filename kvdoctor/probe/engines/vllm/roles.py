"""vLLM's roles for the probe: loaded (as `kvdoctor.probe.engines.vllm.ROLES`) when a vLLM map is in force.

The roles (what a hooked method means to the block ledger, `ledger.blocks.BlockLedger`):

- `vllm_alloc`     `BlockPool.get_new_blocks(n)`: the returned blocks go from count 0 to 1;
- `vllm_touch`     `BlockPool.touch(blocks)`: a prefix-cache hit, +1 per block;
- `vllm_free`      `BlockPool.free_blocks(blocks)` / `unpin_blocks(blocks, ...)`: -1 per block; and
  vLLM's free queue must grow by the blocks it released, each once (a block queued twice is a
  double free, vllm#42571);
- `vllm_cache`     `BlockPool.cache_full_blocks(...)`: full blocks enter the prefix cache (counted);
- `vllm_evict`     `BlockPool._maybe_evict_cached_block(block)`: a cached block's hash dropped (counted);
- `vllm_req_alloc` `KVCacheManager.allocate_slots(request, ...)`: the blocks touched and handed out
  inside it are the request's; a request that got slots is live;
- `vllm_req_free`  `KVCacheManager.free(request)`: the blocks freed inside it were the request's;
  the request is no longer live, and when none is left the engine is idle: a census;
- `vllm_req_pop`   `KVCacheManager.pop_blocks_for_free(request)`: the request is no longer live (its
  blocks come back later through `free_blocks`);
- `vllm_exit`      `EngineCore.shutdown()`: the exit census;
- `vllm_stop_engines` `shutdown(procs)` in the API server: under `kvdoctor run`, each engine core is
  asked for a census before its SIGTERM (`probe/base/shutdown.py`).

Blocks a KV connector keeps after their request finished have their own ledger and roles
(`connector.py`); a census counts them apart from orphans.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.base.shutdown_role import ShutdownRole
from kvdoctor.probe.engines.vllm.blocks import BlockLedger
from kvdoctor.probe.engines.vllm.state import VllmState, state

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


def _request_id(args: Args, kwargs: Kwargs) -> str | None:
    request = kwargs.get("request", args[0] if args else None)
    rid = getattr(request, "request_id", None)
    return str(rid) if rid is not None else None


def _listify(value: Any) -> Any:
    if value is None or isinstance(value, (list, tuple)):
        return value
    return list(value)


# ----- roles -----


class VllmRole(Role):
    """A role that feeds the block ledger."""

    ledger = "blocks"


class _PoolRole(VllmRole):
    """Roles on a `BlockPool`: the call is noted (the engine is not quiet) and the pool's ledger found."""

    frees = False  # the call gives back the blocks of its first argument

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        st = state(probe)
        st.last_call = time.monotonic()
        if id(obj) in st.ledgers:
            return (st, st.ledgers[id(obj)], site)
        in_flight = (args[0] if args else kwargs.get("ordered_blocks", kwargs.get("blocks"))) if self.frees else None
        return (st, st.ledger_for(obj, in_flight), site)


class AllocRole(_PoolRole):
    wants_site = True

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        st, ledger, site = ctx
        if result:
            with ledger.lock:
                ledger.on_alloc(result, obj, site, st.current.request)


class _BlocksRole(_PoolRole):
    """Pool roles whose first argument is an iterable of blocks: one-shot iterators become lists."""

    def prepare_args(self, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        if args:
            return (_listify(args[0]),) + tuple(args[1:]), kwargs
        if "ordered_blocks" in kwargs or "blocks" in kwargs:
            kwargs = dict(kwargs)
            for key in ("ordered_blocks", "blocks"):
                if key in kwargs:
                    kwargs[key] = _listify(kwargs[key])
        return args, kwargs

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        st, ledger, site = ctx
        blocks = args[0] if args else kwargs.get("ordered_blocks", kwargs.get("blocks"))
        if blocks:
            with ledger.lock:
                self.apply(ledger, blocks, obj, site, st.current.request)

    def apply(self, ledger: BlockLedger, blocks: Any, pool: Any, site: int, request: str | None) -> None:
        raise NotImplementedError


class TouchRole(_BlocksRole):
    def apply(self, ledger: BlockLedger, blocks: Any, pool: Any, site: int, request: str | None) -> None:
        ledger.on_touch(blocks, pool, request)


def _queued(pool: Any) -> int | None:
    """vLLM's own count of the blocks on its free queue (a host int), or None where there is none."""
    count = getattr(getattr(pool, "free_block_queue", None), "num_free_blocks", None)
    return count if type(count) is int else None


class FreeRole(_BlocksRole):
    """A free, and what vLLM did with it: its free queue must grow by exactly the blocks whose
    count fell to 0, once each (vLLM 0.22's `free_blocks` queued a block listed twice twice)."""

    wants_site = True
    frees = True

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        return (*super().before(probe, hook, obj, args, kwargs, site), _queued(obj))

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        st, ledger, site, queued_before = ctx
        blocks = args[0] if args else kwargs.get("ordered_blocks", kwargs.get("blocks"))
        if blocks:
            queued_after = _queued(obj)
            with ledger.lock:
                ledger.on_free(blocks, obj, site, st.current.request)
                if queued_before is not None and queued_after is not None:
                    ledger.check_queued(blocks, obj, queued_after - queued_before, site, st.current.request)


class CacheRole(VllmRole):
    reads = {"num_cached_blocks": 2, "num_full_blocks": 3}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        try:
            cached = hook.arg(args, kwargs, "num_cached_blocks")
            full = hook.arg(args, kwargs, "num_full_blocks")
            count = int(full) - int(cached)
        except (TypeError, ValueError):
            return
        ledger = state(probe).ledgers.get(id(obj))
        if ledger is not None and count > 0:
            ledger.on_cache(count)


class EvictRole(VllmRole):
    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        ledger = state(probe).ledgers.get(id(obj))
        if ledger is not None:
            ledger.on_evict(bool(result))


class ReqAllocRole(VllmRole):
    reads = {"request": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        st = state(probe)
        st.last_call = time.monotonic()
        if st.census_due and not st.live and time.monotonic() - st.last_census >= probe.idle_census_interval_s:
            st.census("idle")  # the one the rate limit held back, before this request changes anything
        rid = _request_id(args, kwargs)
        previous = st.current.request
        st.current.request = rid
        return (st, rid, previous)

    def finally_(self, probe: ProbeContext, ctx: Any) -> None:
        if ctx is not None:
            ctx[0].current.request = ctx[2]

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        st, rid, _ = ctx
        st.set_block_size(obj)
        if result is not None:
            st.allocations += 1
            if rid is not None:
                st.live.add(rid)
                if len(st.live) > st.live_peak:
                    st.live_peak = len(st.live)


class ReqFreeRole(ReqAllocRole):
    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        st = state(probe)
        st.last_call = time.monotonic()
        rid = _request_id(args, kwargs)
        previous = st.current.request
        st.current.request = rid
        return (st, rid, previous)

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        st, rid, _ = ctx
        if rid is not None:
            st.live.discard(rid)
        if not st.live and st.ledgers:
            st.idle()


class ReqPopRole(ReqFreeRole):
    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        st, rid, _ = ctx
        if rid is not None:
            st.live.discard(rid)


class ExitRole(VllmRole):
    """`EngineCore.shutdown`: the exit census, before the teardown that may end in SIGKILL."""

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        st = probe.states.get("vllm")
        if isinstance(st, VllmState):
            st.exit_census()
        return None


ROLES: dict[str, Role] = {
    "vllm_alloc": AllocRole(),
    "vllm_touch": TouchRole(),
    "vllm_free": FreeRole(),
    "vllm_cache": CacheRole(),
    "vllm_evict": EvictRole(),
    "vllm_req_alloc": ReqAllocRole(),
    "vllm_req_free": ReqFreeRole(),
    "vllm_req_pop": ReqPopRole(),
    "vllm_exit": ExitRole(),
    "vllm_stop_engines": ShutdownRole(),
}
