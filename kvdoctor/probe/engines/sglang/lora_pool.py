"""SGLang's LoRA memory pool: the adapter uids that hold its buffer slots, against the adapters the
manager has loaded.

`LoRAMemoryPool` keeps `max_loras_per_batch` buffer slots of adapter weights (on the GPU), each held
by one uid (`buffer_id_to_uid`; the base model is uid None, a free slot `EMPTY_SLOT`). An adapter
takes a slot when a batch first uses it (`LoRAManager.fetch_new_loras` -> `prepare_lora_batch`) and
must give it back when it is unloaded. Up to 0.5.15 `LoRAManager.unload_lora_adapter` forgets the
adapter (`configs`, `loras`, `lora_refs`) and leaves its uid in the pool (sglang#21380; 0.5.16 frees
the slot with `LoRAMemoryPool.remove_lora`): a ghost uid that holds a slot and its weights for an
adapter no request can name, until the eviction policy happens to pick it, or fails on it.

On the scheduler's thread, after each hooked load and unload, the probe reads the pool's slot list
and the manager's loaded adapters (Python containers of at most `max_loras_per_batch` entries; no
tensor is read, so no GPU sync): the unloaded uid still in a slot is named at once, with the adapter
and the call site of the unload; every count (pool uids vs loaded adapters) goes to the trace when
it changed, and once more at exit. A manager or pool without the containers this reads turns this
ledger off, said in one `probe_status` line.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.base.rank import ledger_name
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

LEDGER = "lora"
MAX_POOLS = 16  # managers counted one by one in a process (one per model runner)
MAX_SLOTS = 4096  # a pool with more slots than this is not one SGLang builds (max_loras_per_batch)
MAX_NAMES = 256  # unloaded adapters' names kept to name a ghost later; the oldest go first


class NotUnderstood(Exception):
    """The manager or its pool is not laid out as the roles read it."""


class LoraPoolLedger:
    """Per-process: the managers seen (weakly), each pool's name, the last count said, and the
    names of unloaded adapters (bounded) so that a ghost found later is named."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.lock = threading.Lock()
        self.managers: dict[int, tuple[weakref.ref[Any], str]] = {}
        self.said: dict[str, tuple[Any, ...]] = {}
        self.unloaded: dict[str, str] = {}  # uid -> adapter name, insertion-ordered

    def pool_name(self, manager: Any) -> str | None:
        key = id(manager)
        with self.lock:
            known = self.managers.get(key)
            if known is not None and known[0]() is manager:
                return known[1]
            if len(self.managers) >= MAX_POOLS:
                return None
            name = ledger_name("LoRAMemoryPool", len(self.managers))
            self.managers[key] = (weakref.ref(manager), name)
            return name

    def remember_unloaded(self, uid: str, name: str) -> None:
        with self.lock:
            self.unloaded.pop(uid, None)
            self.unloaded[uid] = name
            while len(self.unloaded) > MAX_NAMES:
                self.unloaded.pop(next(iter(self.unloaded)))

    def count(self, probe: ProbeContext, manager: Any, *, when: str, force: bool = False) -> tuple[list[dict[str, Any]], int]:
        """Reads the pool once: its ghosts (slot, uid, adapter) and its number of slots; the count
        goes to the trace when it changed."""
        name = self.pool_name(manager)
        read = read_pool(manager)
        if name is None or read is None:
            return [], 0
        slots, loaded = read
        ghosts = [
            {"slot": slot, "uid": uid, "adapter": self.unloaded.get(uid, "unknown (never unloaded while the probe watched)")}
            for slot, uid in enumerate(slots)
            if isinstance(uid, str) and uid not in loaded
        ]
        held = [uid for uid in slots if isinstance(uid, str)]
        key = (tuple(held), len(loaded))
        if force or self.said.get(name) != key:
            self.said[name] = key
            probe.emitter.emit(
                schema.LORA_POOL,
                {
                    "pool": name,
                    "when": when,
                    "slots": len(slots),
                    "pool_uids": len(held),
                    "base_model_slots": sum(1 for uid in slots if uid is None),
                    "loaded_adapters": len(loaded),
                    "ghost_uids": len(ghosts),
                    "ghosts": ghosts[:16],
                },
            )
        return ghosts, len(slots)

    def periodic(self, probe: ProbeContext) -> None:
        return None  # counted on the scheduler's thread at each load and unload, not from here

    def close(self, probe: ProbeContext, reason: str) -> None:
        if not probe.ledger_is_on(LEDGER):
            return
        for ref, _ in list(self.managers.values()):
            manager = ref()
            if manager is not None:
                try:
                    self.count(probe, manager, when=reason, force=True)
                except NotUnderstood as exc:
                    turn_off(probe, exc)
                    return


def read_pool(manager: Any) -> tuple[list[Any], set[str]] | None:
    """The pool's slots (uid per slot) and the loaded adapters' uids; None while the pool is not built
    yet (adapters given at start are loaded before it). NotUnderstood for any other layout."""
    pool = getattr(manager, "memory_pool", None)
    if pool is None:
        return None
    slots = getattr(pool, "buffer_id_to_uid", None)
    loaded = getattr(manager, "loras", None)
    if not isinstance(slots, list) or not isinstance(loaded, dict):
        raise NotUnderstood(
            f"{type(pool).__name__}.buffer_id_to_uid is {type(slots).__name__}, {type(manager).__name__}.loras is "
            f"{type(loaded).__name__} (a list and a dict were expected)"
        )
    if len(slots) > MAX_SLOTS:
        raise NotUnderstood(f"{type(pool).__name__} has {len(slots)} buffer slots (more than {MAX_SLOTS})")
    return list(slots), {uid for uid in list(loaded) if isinstance(uid, str)}


def turn_off(probe: ProbeContext, exc: Exception) -> None:
    probe.turn_off_ledger(LEDGER, "the LoRA pool ledger", exc)


def state(probe: ProbeContext) -> LoraPoolLedger:
    return probe.state(LEDGER, LoraPoolLedger)


class LoraLoadRole(Role):
    """`LoRAManager.load_lora_adapter(lora_ref)`: the manager is met, and its pool counted."""

    ledger = LEDGER

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        try:
            state(probe).count(probe, obj, when="load")
        except NotUnderstood as exc:
            turn_off(probe, exc)


class LoraUnloadRole(Role):
    """`LoRAManager.unload_lora_adapter(lora_ref)`: once it returned, the adapter's uid must hold no
    slot of the pool; one that does is the ghost of sglang#21380, named with the unload's call site."""

    ledger = LEDGER
    wants_site = True
    reads = {"lora_ref": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        ref = hook.arg(args, kwargs, "lora_ref")
        uid, name = getattr(ref, "lora_id", None), getattr(ref, "lora_name", None)
        return (site, uid, str(name)) if isinstance(uid, str) else None

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if ctx is None:
            return
        site, uid, name = ctx
        lora = state(probe)
        if getattr(result, "success", True) is False:
            return  # the adapter stays loaded: nothing was to be freed
        lora.remember_unloaded(uid, name)
        try:
            ghosts, slots = lora.count(probe, obj, when="unload")
        except NotUnderstood as exc:
            turn_off(probe, exc)
            return
        mine = [g for g in ghosts if g["uid"] == uid]
        if not mine:
            return
        pool = lora.pool_name(obj)
        probe.emitter.emit(
            schema.VIOLATION,
            {
                "kind": schema.LORA_GHOST_UID,
                "count": len(mine),
                "allocator": pool,
                "site": probe.sites.name(site),
                "slot_ids": [g["slot"] for g in mine],
                "adapters": {f"{name} (uid {uid})": len(mine)},
                "pool_slots": slots,
                "ghost_uids": len(ghosts),
                "unload": f"{type(obj).__name__}.unload_lora_adapter",
            },
        )


ROLES: dict[str, Role] = {"lora_load": LoraLoadRole(), "lora_unload": LoraUnloadRole()}
