"""HiCache: the host (L2) pool and the storage (L3) backend, the views the tree retains, and CUDA
graph replays during a host-to-device load.

Host pools hand out index tensors; a tensor that is a small view into a much larger array, kept
alive by a long-lived tree node, pins that whole array (sglang#19332). We keep weak references to
the views the host pool hands out (bounded), and every few seconds count the ones still alive,
old enough to be long-lived, and far smaller than the storage they keep alive.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.engines.sglang.host_slots import HostSlots
from kvdoctor.probe.engines.sglang.state import sglang_state
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

MAX_TRACKED_VIEWS = 100_000
LONG_LIVED_S = 5.0
SCAN_INTERVAL_S = 2.0
VIEW_RATIO = 4  # storage at least this many times the view's own bytes
MAX_NAMED = 16  # request ids and loaded tree nodes named in one graph-replay violation


class HiCacheLedger:
    """Per-process HiCache bookkeeping: host pools, controller queues, storage traffic, views."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.hosts: dict[int, Any] = {}
        self.slots = HostSlots()  # each host pool's pages: double frees and double allocs (host_slots.py)
        self.controllers: dict[int, Any] = {}
        # id(view) -> (weak reference, storage bytes, own bytes, allocating site, monotonic birth time)
        self.views: dict[int, tuple[weakref.ref[Any], int, int, str, float]] = {}
        self.storing_sites: dict[str, int] = {}
        # thread id -> the device slots the controller's loads gave out inside a tree's load_back there
        self.loading: dict[int, list[Any]] = {}
        self.alloc_sites: dict[str, int] = {}
        self.counts = {
            "host_allocs": 0,
            "host_frees": 0,
            "backups": 0,
            "loads": 0,
            "storage_sets": 0,
            "storage_set_pages": 0,
            "storage_gets": 0,
            "storage_get_pages": 0,
            "graph_replays": 0,
            "graph_replays_during_load": 0,
        }
        self.lock = threading.Lock()
        self.last_scan = 0.0
        self.last_report: tuple[int, int] = (0, 0)

    def periodic(self, probe: ProbeContext) -> None:
        if not probe.ledger_is_on("hicache"):
            return
        args: dict[str, Any] = dict(self.counts)
        for host in list(self.hosts.values()):
            try:
                args["host_total_slots"] = args.get("host_total_slots", 0) + int(host.size)
                args["host_free_slots"] = args.get("host_free_slots", 0) + int(host.available_size())
            except Exception:
                pass
        for controller in list(self.controllers.values()):
            for name in ("write_queue", "load_queue", "ack_write_queue", "ack_load_queue"):
                queue = getattr(controller, name, None)
                if queue is not None and hasattr(queue, "__len__"):
                    args[f"{name}_depth"] = args.get(f"{name}_depth", 0) + len(queue)
        if "host_total_slots" in args:
            args["host_used_slots"] = args["host_total_slots"] - args.get("host_free_slots", 0)
        probe.emitter.counter(schema.HICACHE_COUNTER, args)
        now = time.monotonic()
        if now - self.last_scan >= SCAN_INTERVAL_S:
            self.last_scan = now
            self.scan_views(probe, now)

    def track_view(self, tensor: Any, site: str) -> None:
        base = getattr(tensor, "_base", None)
        if base is None:
            return
        try:
            storage_bytes = int(tensor.untyped_storage().nbytes())
            own_bytes = int(tensor.numel() * tensor.element_size())
        except Exception:
            return
        if storage_bytes < VIEW_RATIO * max(own_bytes, 1):
            return
        with self.lock:
            if len(self.views) >= MAX_TRACKED_VIEWS:
                return  # bounded: the count below is then a lower bound
            key = id(tensor)

            def forget(_ref: weakref.ref[Any], key: int = key) -> None:
                self.views.pop(key, None)

            self.views[key] = (weakref.ref(tensor, forget), storage_bytes, own_bytes, site, time.monotonic())

    def scan_views(self, probe: ProbeContext, now: float | None = None, *, force_report: bool = False) -> dict[str, Any] | None:
        now = time.monotonic() if now is None else now
        live = 0
        own = 0
        storages: dict[int, int] = {}
        sites: dict[str, int] = {}
        with self.lock:
            entries = list(self.views.values())
        for ref, storage_bytes, own_bytes, site, born in entries:
            tensor = ref()
            if tensor is None or now - born < LONG_LIVED_S:
                continue
            live += 1
            own += own_bytes
            try:
                storages[tensor.untyped_storage().data_ptr()] = storage_bytes
            except Exception:
                continue
            sites[site] = sites.get(site, 0) + 1
        retained_bytes = sum(storages.values())
        summary: dict[str, Any] = {
            "long_lived_views": live,
            "retained_bytes": retained_bytes,
            "distinct_storages": len(storages),
            "own_bytes": own,
            "alloc_sites": sites,
            "storing_sites": dict(self.storing_sites),
            "tracked": len(entries),
            "tracking_capped": len(entries) >= MAX_TRACKED_VIEWS,
            "min_age_s": LONG_LIVED_S,
        }
        key = (live, retained_bytes)
        if live and (force_report or key != self.last_report):
            self.last_report = key
            probe.emitter.emit(schema.RETAINED_VIEWS, summary)
        return summary

    def close(self, probe: ProbeContext, reason: str) -> None:
        """The last count of retained views, however recent the previous one: a periodic scan taken
        mid-run, before the views had piled up, must not be the trace's last word on them."""
        if probe.ledger_is_on("hicache") and self.views:
            self.scan_views(probe)


class HiCacheRole(Role):
    """A role that feeds HiCache's bookkeeping (host pool, controller queues, storage, views)."""

    ledger = "hicache"


def state(probe: ProbeContext) -> HiCacheLedger:
    return probe.state("hicache", HiCacheLedger)


class HostAllocRole(HiCacheRole):
    wants_site = True

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        st = state(probe)
        st.hosts[id(obj)] = obj
        st.slots.meet(probe, obj)
        return site

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        st = state(probe)
        st.counts["host_allocs"] += 1
        st.slots.handed_out(probe, obj, result, ctx)
        if result is not None and "clone-host-indices" not in probe.fixes:
            st.track_view(result, probe.sites.name(ctx))

    def rewrite_result(self, probe: ProbeContext, obj: Any, result: Any) -> Any:
        if result is not None and "clone-host-indices" in probe.fixes and getattr(result, "_base", None) is not None:
            probe.fixed("clone-host-indices", 1)
            return result.clone()
        return result


class HostFreeRole(HiCacheRole):
    """`free(indices)`: judged before the call (0.5.23's pool asserts on a double free of its own)."""

    wants_site = True
    reads = {"indices": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        st = state(probe)
        st.hosts[id(obj)] = obj
        st.counts["host_frees"] += 1
        st.slots.given_back(probe, obj, hook.arg(args, kwargs, "indices"), site)


class HostClearRole(HiCacheRole):
    """`clear()`: every page free again, read back from the pool."""

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state(probe).slots.cleared(probe, obj)


class HostReleaseRole(HiCacheRole):
    """`HiCacheController.append_host_mem_release(host_indices)`: pages queued for the scheduler's
    drain to free (the IO threads queue them; sglang#13483 queued some twice)."""

    wants_site = True
    reads = {"host_indices": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        state(probe).slots.queued(probe, getattr(obj, "mem_pool_host", None), hook.arg(args, kwargs, "host_indices"), site)


class ControllerRole(HiCacheRole):
    counter = ""

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        st = state(probe)
        st.controllers[id(obj)] = obj
        host = getattr(obj, "mem_pool_host", None)
        if host is not None:
            st.hosts[id(host)] = host
        if self.counter:
            st.counts[self.counter] += 1
        return site


class BackupRole(ControllerRole):
    counter = "backups"


class LoadRole(ControllerRole):
    """A load's result is its device slots: inside a tree's `load_back` that returns only whether it
    loaded (UnifiedRadixCache), they are kept for it to give to the tree."""

    counter = "loads"

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        stash = state(probe).loading.get(threading.get_ident())
        if stash is not None and result is not None and hasattr(result, "numel"):
            stash.append(result)


class TreeBackupRole(HiCacheRole):
    """`write_backup` stores the host indices on the node: name that as the storing site."""

    reads = {"node": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        node = hook.arg(args, kwargs, "node")
        value = getattr(node, "host_value", None)
        if value is not None and getattr(value, "_base", None) is not None:
            st = state(probe)
            name = f"{type(obj).__name__}.write_backup stores host indices as node.host_value"
            st.storing_sites[name] = st.storing_sites.get(name, 0) + 1


class TreeLoadRole(HiCacheRole):
    """`load_back` gives freshly allocated device slots to evicted tree nodes: they are the tree's
    now, not a request's (without this every loaded page would look orphaned at a census), so it
    belongs to the slot ledger. Up to 0.5.19 it returns them; UnifiedRadixCache's returns whether it
    loaded, and the slots are the ones its controller's `load` gave out on this thread meanwhile."""

    ledger = "slots"
    wants_site = True

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        stash: list[Any] = []
        state(probe).loading[threading.get_ident()] = stash
        return site, stash

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        site, stash = ctx if isinstance(ctx, tuple) else (ctx or 0, [])
        loaded = [result] if hasattr(result, "numel") else stash if result is True else []
        ledger = sglang_state(probe).tree_ledger(obj)
        if ledger is None:
            return
        for slots in loaded:
            if slots.numel():
                with ledger.lock:
                    ledger.on_tree_insert(slots, site)

    def finally_(self, probe: ProbeContext, ctx: Any) -> None:
        state(probe).loading.pop(threading.get_ident(), None)


class StorageRole(HiCacheRole):
    kind = ""
    reads = {"keys": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        st = state(probe)
        keys = hook.arg(args, kwargs, "keys")
        st.counts[f"storage_{self.kind}s"] += 1
        if isinstance(keys, (list, tuple)):
            st.counts[f"storage_{self.kind}_pages"] += len(keys)


class StorageSetRole(StorageRole):
    kind = "set"


class StorageGetRole(StorageRole):
    kind = "get"


ROLES: dict[str, Role] = {
    "host_alloc": HostAllocRole(),
    "host_free": HostFreeRole(),
    "host_clear": HostClearRole(),
    "host_release": HostReleaseRole(),
    "hicache_write": BackupRole(),
    "hicache_load": LoadRole(),
    "tree_backup": TreeBackupRole(),
    "tree_load": TreeLoadRole(),
    "storage_set": StorageSetRole(),
    "storage_get": StorageGetRole(),
}
