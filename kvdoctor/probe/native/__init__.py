"""The native path (`_native`, a C extension: kvdoctor/probe/native/csrc/), and the pure-Python
fallback beside it.

The probe's wrappers, re-entry bookkeeping and the slot ledger's healthy-case updates run in C
when the extension is importable: a Python wrapper reading index tensors through torch's Python
API costs more per hooked call than SGLang's own allocator call. The roles stay the source of
truth: the extension takes only the cases it has checked to be healthy and hands everything else
(violations and their evidence, censuses, fixes, injected faults) to the same Python code.

Index tensors are read where torch keeps their fields (places learned at start on `index_samples`
and checked against DLPack's answers, every 1024th read compared again), else through torch's
DLPack C table, else through its getters; `KVDOCTOR_NATIVE_DIRECT=0` and `KVDOCTOR_NATIVE_DLPACK=0`
step down the first one or two.

`KVDOCTOR_NATIVE=0` keeps a process on the Python path (the tests compare the two); which path a
process runs, and why, is `CHOICE` (native/loader.py). Nothing here raises: a missing or
mismatched extension means the Python path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Role
from kvdoctor.probe.base.settings import env_text
from kvdoctor.probe.native.loader import NativeChoice, load

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import Hook, ProbeContext

ENV_DLPACK = "KVDOCTOR_NATIVE_DLPACK"  # 0: index tensors read through torch's Python getters only
ENV_DIRECT = "KVDOCTOR_NATIVE_DIRECT"  # 0: never read torch's tensor fields in place (DLPack only)
MAX_LEDGER_BITS = 32
MAX_ROLE_BITS = 64

NATIVE: Any
CHOICE: NativeChoice  # which path this process runs, and why (said in the trace header)
NATIVE, CHOICE = load()

# The ledger operation each role kind is (`Role.fast_kind`); "" is the generic path.
KINDS = (
    {}
    if NATIVE is None
    else {
        "": NATIVE.K_GENERIC,
        "note": NATIVE.K_NOTE,
        "alloc": NATIVE.K_ALLOC,
        "free": NATIVE.K_FREE,
        "tree_insert": NATIVE.K_TREE_IN,
        "tree_evict": NATIVE.K_TREE_OUT,
        "tree_unlock": NATIVE.K_TREE_UNLOCK,
        "req_write": NATIVE.K_OWNER_WRITE,
        "req_alloc": NATIVE.K_ROW_ALLOC,
        "req_free": NATIVE.K_ROW_FREE,
        "req_free_rows": NATIVE.K_ROWS_FREE,
        "last_loc": NATIVE.K_LAST_LOC,
    }
)

# What each operation reads: its arguments, then the attributes and methods of the host's objects,
# by the keys under which a role's `fast_names` names them, in the order of the extension's slots
# (native.h's A_* and T_*). The C knows no engine's names: a role declares them.
READS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "alloc": (("loc",), ()),
    "tree_insert": (("carrier",), ("owner", "size", "size_also", "slots", "prefix", "aside")),
    "tree_evict": ((), ("owner",)),
    "tree_unlock": (("node",), ("count", "root")),
    "req_write": (("rows", "slots"), ()),
    "req_alloc": (("requests",), ("id",)),
    "req_free": (("request",), ("table",)),
    "req_free_rows": (("rows",), ("table",)),
    "last_loc": (("table", "rows", "prefix"), ()),
}


def active() -> bool:
    """Whether this process's hooks are the compiled ones."""
    return NATIVE is not None


class _Bits:
    """Small integers for ledger and role names: the extension tests bit masks, not strings."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.ids: dict[str, int] = {}
        self.lock = threading.Lock()

    def id(self, name: str) -> int:
        found = self.ids.get(name)
        if found is None:
            with self.lock:
                found = self.ids.setdefault(name, len(self.ids))
        return found

    def bit(self, name: str) -> int:
        """The name's bit, or 0 past the limit (such a name is never switched by mask)."""
        i = self.id(name)
        return 1 << i if i < self.limit else 0

    def mask(self, names: Any) -> int:
        out = 0
        for name in names:
            out |= self.bit(name)
        return out


LEDGER_BITS = _Bits(MAX_LEDGER_BITS)
ROLE_BITS = _Bits(MAX_ROLE_BITS)


def _overridden(role: Role, name: str) -> Callable[..., Any] | None:
    """The role's bound method, or None where it is the base class's no-op (not worth a call)."""
    if getattr(type(role), name) is getattr(Role, name):
        return None
    method: Callable[..., Any] = getattr(role, name)
    return method


def _fast_kind(role: Role) -> str:
    """The role's fast path: its declared kind, "note" for a role that overrides nothing, or the
    generic path where a role prepares its arguments (the fast paths never do)."""
    if _overridden(role, "prepare_args") is not None:
        return ""
    kind = getattr(role, "fast_kind", "")
    if kind:
        return str(kind)
    if all(_overridden(role, m) is None for m in ("before", "after", "finally_", "rewrite", "rewrite_result")):
        return "note"
    return ""


def _reads(kind: str, role: Role, hook: Hook) -> dict[str, Any]:
    """The arguments (position in the map's signature, name) and attributes the operation reads,
    from the role's `fast_names`."""
    names: dict[str, str] = dict(getattr(role, "fast_names", {}))
    arg_keys, attr_keys = READS.get(kind, ((), ()))
    args = tuple((int(hook.positions.get(names[k], -1)) if k in names else -1, names.get(k)) for k in arg_keys)
    return {"args": args, "attrs": tuple(names.get(k) for k in attr_keys)}


def wrap(original: Callable[..., Any], role: Role, hook: Hook) -> Callable[..., Any]:
    """The compiled wrapper of one method: what `hooks.wrap_method` builds in Python."""
    import functools

    kind = _fast_kind(role)
    options = hook.options
    group_attr = options.get("group_attr") or None
    index_attr = options.get("req_index_attr") or dict(getattr(role, "fast_names", {})).get("index")
    wrapper = NATIVE.Hooked(
        original,
        role,
        hook,
        hook.role,
        ROLE_BITS.id(hook.role),
        LEDGER_BITS.bit(hook.ledger) if hook.ledger else 0,
        ROLE_BITS.bit(hook.role),
        composite=role.composite,
        wants_site=role.wants_site,
        kind=KINDS.get(kind, NATIVE.K_GENERIC),
        before=_overridden(role, "before"),
        after=_overridden(role, "after"),
        rewrite=_overridden(role, "rewrite"),
        finally_=_overridden(role, "finally_"),
        prepare=_overridden(role, "prepare_args"),
        rewrite_result=_overridden(role, "rewrite_result"),
        only_page_starts=bool(getattr(role, "only_page_starts", False)),
        as_pages=bool(getattr(role, "as_pages", False)),
        group_attr=str(group_attr) if group_attr else None,
        group_open_when_false=options.get("group_open_when") == "false",
        index_path=tuple(str(index_attr).split(".")) if index_attr else None,
        **_reads(kind, role, hook),
    )
    functools.update_wrapper(wrapper, original)
    wrapper.__kvdoctor_role__ = hook.role
    return wrapper  # type: ignore[no-any-return]


def wrap_function(original: Callable[..., Any], role: Role, hook: Hook) -> Callable[..., Any]:
    """The compiled wrapper of a module-level function: the host's call, then the role's `after` on
    its result (`get_last_loc`'s is done in C)."""
    import functools

    kind = str(getattr(role, "fast_kind", ""))
    wrapper = NATIVE.Hooked(
        original,
        role,
        hook,
        hook.role,
        ROLE_BITS.id(hook.role),
        LEDGER_BITS.bit(hook.ledger) if hook.ledger else 0,
        ROLE_BITS.bit(hook.role),
        kind=KINDS.get(kind, NATIVE.K_GENERIC),
        after=_overridden(role, "after"),
        function=True,
        **_reads(kind, role, hook),
        sources_max=int(getattr(role, "sources_max", 0)),  # only the last_loc kind remembers: its role says how many
    )
    functools.update_wrapper(wrapper, original)
    wrapper.__kvdoctor_role__ = hook.role
    return wrapper  # type: ignore[no-any-return]


def sync(probe: ProbeContext | None) -> None:
    """Tells the extension the probe's switches; called whenever one of them changes."""
    if NATIVE is None:
        return
    if probe is None:
        NATIVE.configure(None, False, 0, False, 0)
        return
    ensure_torch()
    NATIVE.configure(
        probe, probe.ledger_on, LEDGER_BITS.mask(probe.ledgers_off), bool(probe.fixes), ROLE_BITS.mask(probe.inject), probe.sites.at
    )


_TORCH_SEEN: Any = None


def ensure_torch() -> None:
    """What an index tensor is, once torch is loaded (the probe never imports it itself)."""
    global _TORCH_SEEN
    import sys

    torch = sys.modules.get("torch")
    if torch is None or NATIVE is None:
        return
    use = _switched_on(ENV_DLPACK)
    direct = use and _switched_on(ENV_DIRECT)
    if _TORCH_SEEN == (id(torch), use, direct):
        return
    try:
        NATIVE.set_torch(torch.Tensor, torch.int64, torch.int32, index_samples(torch) if use else [], use, direct)
        _TORCH_SEEN = (id(torch), use, direct)
    except Exception:
        pass


def _switched_on(name: str) -> bool:
    return (env_text(name) or "1").lower() not in ("0", "off", "false", "no")


def index_samples(torch: Any) -> list[Any]:
    """Tensors of every shape the readers must agree on before the DLPack one is trusted: both
    index dtypes, views with an offset, strided and transposed views, one element, empty, other
    dtypes (declined by both), tensors made under inference mode (other dispatch keys) and a meta
    tensor (no data: DLPack cannot describe it; the in-place reader learns the device from it)."""
    base = torch.arange(24, dtype=torch.int64)
    with torch.inference_mode():
        inference = [torch.arange(12, dtype=torch.int64)[2:], torch.arange(6, dtype=torch.int32)]
    return [
        *inference,
        torch.empty(3, dtype=torch.int64, device="meta"),
        base,
        base[5:9],
        base[::3],
        base[7:8],
        base.view(4, 6),
        base.view(4, 6).t(),
        base.view(4, 6)[:, 2:3],
        base.view(24, 1),
        torch.arange(10, dtype=torch.int32)[3:],
        torch.tensor(11),
        torch.tensor(-12, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int16),
        torch.zeros(3, dtype=torch.float32),
        torch.zeros(3, dtype=torch.bool),
        torch.zeros(3, dtype=torch.uint8),
    ]


def reset() -> None:
    """Forgets every ledger, state and call-site key (the probe was deactivated)."""
    if NATIVE is not None:
        NATIVE.reset()


def calls() -> int:
    """Hooked calls the extension dispatched in this process (0 without it)."""
    return int(NATIVE.calls()) if NATIVE is not None else 0


def register_ledger(allocator: Any, ledger: Any, options: dict[str, Any]) -> bool:
    """Lets the fast paths update a host ledger (numpy arrays on the CPU, no kernels); `options`
    are the map's for the allocator's class (its free group)."""
    if NATIVE is None or not getattr(ledger.xp, "sync_free_branching", False) or ledger.kernels is not None:
        return False
    group_attr = options.get("group_attr") or None
    ensure_torch()
    history = getattr(ledger, "history", None)  # its flight recorder, which the C writes too
    recorder = {} if history is None else {"hist": history.hist, "head": history.head, "clock": history.clock, "hist_n": history.entries}
    return bool(
        NATIVE.register_ledger(
            allocator,
            ledger,
            ledger.state,
            ledger.owner,
            ledger.alloc_site,
            ledger.rows,
            ledger.page_size,
            ledger.num_pages,
            ledger.sink,
            ledger.lock,
            str(group_attr) if group_attr else None,
            options.get("group_open_when") == "false",
            **recorder,
        )
    )


def set_context(state: Any, requests: Any, sources: dict[int, Any], names: dict[str, str]) -> None:
    """The engine's state, its request table and its last-loc sources, and the name each operation
    the fast paths call has there (context.c's keys)."""
    if NATIVE is not None:
        NATIVE.set_context(state, requests, sources, names)


def set_primary(allocator: Any) -> None:
    if NATIVE is not None:
        NATIVE.set_primary(allocator)


def set_row_extent(extent: Any) -> None:
    if NATIVE is not None:
        NATIVE.set_row_extent(extent)


def set_divert(flag: bool) -> None:
    if NATIVE is not None:
        NATIVE.set_divert(flag)


# ----- the ledger's lock -----

_LOCKS: Any = None  # every FastLock made, for the fork handler


def new_lock() -> Any:
    """A reentrant lock for a ledger: the extension's (which it takes without a method call) or
    threading.RLock. Both are used as `with lock:` by the Python code."""
    global _LOCKS
    if NATIVE is None:
        return threading.RLock()
    import weakref

    if _LOCKS is None:
        _LOCKS = weakref.WeakSet()
        os.register_at_fork(after_in_child=_reinit_locks)
    lock = NATIVE.FastLock()
    _LOCKS.add(lock)
    return lock


def _reinit_locks() -> None:
    """In a forked child the threads that held ledger locks in the parent do not exist."""
    for lock in list(_LOCKS or ()):
        try:
            lock._at_fork_reinit()
        except Exception:
            pass


# ----- tree evictions in progress on this thread (frees inside one leave the tree bit alone) -----


class _Evictions(threading.local):
    def __init__(self) -> None:
        self.count = 0


_EVICTIONS = _Evictions()


def evicting() -> bool:
    if NATIVE is not None:
        return bool(NATIVE.evicting())
    return _EVICTIONS.count > 0


def evict_add(delta: int) -> None:
    if NATIVE is not None:
        NATIVE.evict_add(delta)
    else:
        _EVICTIONS.count += delta
