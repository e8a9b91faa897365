"""Which of the engine's pools a slot ledger can judge, proven from the objects the engine built.

A ledger names orphans only when every holder of its pool's slots is seen: the free list (the
allocator's hooked methods), the radix tree, and the requests' rows. That holds for the engine's
own `token_to_kv_pool_allocator` when its exact class is one the probe map describes and the
engine's `req_to_token_pool` is a hooked request pool. It does not hold for:

- an allocator of a class the map does not name (SWA, Mamba, hybrid and unified composites): its
  methods are hooked only where it inherits them from a mapped base;
- an allocator inside such a composite: its slots are also held through the composite's own
  mappings, which the probe does not follow. SGLang's SWA pool (`SWATokenToKVPoolAllocator`) is
  the exception, judged as one pool of two sides (`swa_sides.py`): its full part's ledger holds
  the composite's tree and rows, its SWA part's holders are read from SGLang at idle and exit;
- a request pool that is not a hooked class (PD decode's `DecodeReqToTokenPool`), or one whose row
  writer is its own (a subclass overriding `write`): which request owns a slot is not seen, so slots
  in use would look orphaned;
- a request table on a device (not the host) where the map says the release writes a prefill
  batch's rows with a kernel launched in place (`prefill_rows_unhooked`: SGLang 0.5.1-0.5.3.post1's
  `ScheduleBatch.prepare_for_extend` launches `write_req_to_token_pool_triton` whenever the attention
  backend supports Triton, and calls the hooked `ReqToTokenPool.write` only on its fallback branch,
  which a host table takes);
- an engine decoding speculatively (its scheduler's, a batch's or a model runner's `spec_algorithm`)
  where the map hooks no speculative row writer (`req_write_spans`: SGLang launches a kernel,
  `assign_req_to_token_pool`, through `assign_req_to_token_pool_func` from 0.5.4.post2, inline before),
  or names the algorithm as one whose kernel is launched in place (NGRAM before 0.5.14).

Such a ledger keeps counting (double frees and out-of-range indices are still its own), says why
it is not judged, and names no orphan. The engine's objects are found from the calls the probe sees:
the nearest caller whose `self` names a `token_to_kv_pool_allocator` (the scheduler, a batch), and
every radix tree, which names its allocator and request pool. A process may hold several engines
(each allocator is paired with the request pool named beside it).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

from kvdoctor.probe.base.objects import instance_items, own, own_slot

MAX_FRAMES = 64
MAX_SPECULATIVE_SEEKS = 8  # allocations whose callers are searched for the engine's speculative algorithm
ENGINE_ATTRS = ("token_to_kv_pool_allocator", "req_to_token_pool", "tree_cache")


def caller_selves() -> Iterator[tuple[str, Any]]:
    """(function name, its `self`) for each caller that has a `self`, nearest first, within
    MAX_FRAMES; only frames that name `self` have their locals read."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame is None:
            return
        code = frame.f_code
        if "self" in code.co_varnames:
            obj = frame.f_locals.get("self")
            if obj is not None:
                yield code.co_name, obj
        frame = frame.f_back


def engine_callers(target: Any) -> Iterator[Any]:
    """Each caller's `self` (nearest first) that names an engine's allocator, `target` excepted."""
    for _, obj in caller_selves():
        if obj is not target and own(obj, "token_to_kv_pool_allocator") is not None:
            yield obj


def engine_view(target: Any) -> Any:
    """The nearest caller's `self` that names the engine's allocator, or None."""
    return next(engine_callers(target), None)


def part_name(allocator: Any) -> str:
    """The part `allocator` plays in a composite allocator ('full' and 'swa' in an SWA pool, from
    the composite's `full_attn_allocator` / `swa_attn_allocator`), found from the callers' `self`
    (the composite whose call reached it, or an engine object whose allocator holds it); '' when
    no caller holds it as a part. Read once, when its ledger is made."""
    for _, obj in caller_selves():
        for holder in (obj, own(obj, "token_to_kv_pool_allocator")):
            if holder is None or holder is allocator:
                continue
            for key, value in instance_items(holder):
                if value is allocator and key not in ENGINE_ATTRS:  # the engine's own allocator is no part
                    return _part_label(key)
    return ""


def constructing(obj: Any) -> bool:
    """`obj`'s own `__init__` is among the callers: the object is being built."""
    return any(name == "__init__" and caller is obj for name, caller in caller_selves())


def _part_label(attribute: str) -> str:
    label = attribute.strip("_")
    for suffix in ("_attn_allocator", "_allocator"):
        if label.endswith(suffix) and len(label) > len(suffix):
            return label[: -len(suffix)]
    return label


def class_names(obj: Any) -> set[str]:
    return {c.__name__ for c in type(obj).__mro__}


def why_not_judged(
    allocator: Any,
    holder: Any,
    requests: Any,
    classes: dict[str, set[str]],
    request_methods: dict[str, list[str]],
    speculative_rows: str = "",
    prefill_rows: str = "",
) -> str:
    """'' when the ledger of `allocator` can judge orphans, else the reason, in one sentence.
    `holder`: another allocator that holds it as a part (None if none is known); `requests`: the
    request pool named beside it (None until seen); `request_methods`: the map's request pool
    classes and their hooked methods; `speculative_rows`: why speculative decoding's row writes are
    not seen ('' when they are, or the engine does not decode speculatively); `prefill_rows`: why
    a prefill batch's row writes are not seen ('' when they are: `prefill_rows_unseen`)."""
    name = type(allocator).__name__
    if name not in classes["allocator"]:
        return f"{name} is a pool the probe map does not describe (only the methods it inherits are hooked)"
    if holder is not None:
        return f"it is a part of {type(holder).__name__}, whose slots are also held through mappings the probe does not follow"
    unhooked = unhooked_methods(requests, request_methods) if requests is not None else []
    if unhooked:
        return (
            f"the request pool {type(requests).__name__} is not hooked ({', '.join(unhooked[:4])}): which request holds a slot is not seen"
        )
    if prefill_rows:
        return f"{prefill_rows}: which request holds a slot is not seen"
    if speculative_rows:
        return f"{speculative_rows}: which request holds a slot is not seen"
    return ""


def prefill_rows_unseen(requests: Any, launched_in_place: str) -> str:
    """Why a prefill batch's request rows are not seen, or '': `launched_in_place`, the map's
    `prefill_rows_unhooked` (where the release launches the kernel that writes them, '' when a
    hooked writer sees them); `requests`, the engine's request pool (None until seen: decided
    then). The kernel's branch is taken for a table on a device; a host table takes the fallback,
    which writes through the hooked `ReqToTokenPool.write`. A table whose device cannot be read is
    not proven to be the host's. The device is a host attribute of the tensor: no value is read."""
    if not launched_in_place or requests is None:
        return ""
    device = getattr(own(requests, "req_to_token"), "device", None)
    if getattr(device, "type", None) == "cpu":
        return ""
    where = f"a request table on {device}" if device is not None else "a request table whose device is not known"
    return f"prefill rows are written by a kernel this release launches in place ({launched_in_place}), which no hook sees, into {where}"


def speculative_algorithm(holder: Any) -> str | None:
    """The speculative decoding algorithm an engine object names (`spec_algorithm`: the scheduler,
    a batch, a model runner): '' for none, None when it names none. An enum member's name is read
    from its own attributes (no host code runs); a plugin's algorithm object by its class."""
    value = own(holder, "spec_algorithm")
    if value is None:
        return None
    name = algorithm_name(value)
    return "" if name == "NONE" else name


def algorithm_name(value: Any) -> str:
    """An algorithm value's own name: an Enum member's `_name_` (an IntEnum up to 0.5.4.post1, whose
    attribute lookup is int's, so `own` does not read it: every engine read as speculative there), a
    registry object's `name` (0.5.4.post2-0.5.7, a class of SGLang's own with `__slots__`), else its
    class's name."""
    if isinstance(value, enum.Enum):
        try:
            attrs = object.__getattribute__(value, "__dict__")  # what the enum machinery set; no host code
        except AttributeError:
            attrs = None
        name = attrs.get("_name_") if type(attrs) is dict else None
    else:
        name = own(value, "_name_")
        if not isinstance(name, str):
            name = own(value, "name")
        if not isinstance(name, str):
            name = own_slot(value, "name")
    return name if isinstance(name, str) else type(value).__name__


def speculative_rows_unseen(algorithm: str | None, writers: list[str], launched_in_place: list[str]) -> str:
    """Why the rows speculative decoding writes are not seen, or '': `writers`, the row writers the
    map hooks; `launched_in_place`, the algorithms whose kernel the map says is launched past them."""
    if not algorithm:
        return ""
    if not writers:
        return f"speculative decoding ({algorithm}) writes request rows with a kernel the probe map for this release does not hook"
    if algorithm in launched_in_place:
        return f"speculative decoding ({algorithm}) writes request rows with a kernel launched in place, not through {writers[0]}"
    return ""


def values(obj: Any) -> list[Any]:
    """An object's instance attributes (no property runs)."""
    return [value for _, value in instance_items(obj)]


def is_hook(function: Any) -> bool:
    """Our wrapper, or a wrapper around it (functools.wraps keeps `__wrapped__`)."""
    for _ in range(8):
        if function is None:
            return False
        if getattr(function, "__kvdoctor_role__", None):
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def unhooked_methods(pool: Any, request_methods: dict[str, list[str]]) -> list[str]:
    """The methods of a request pool that write or give back rows without passing through a hook:
    all of them when its class derives from no mapped request pool."""
    names = class_names(pool)
    methods = sorted({m for cls, ms in request_methods.items() if cls in names for m in ms})
    if not methods:
        return [f"{type(pool).__name__} derives from no request pool the probe map names"]
    return [f"{type(pool).__name__}.{m}" for m in methods if not is_hook(getattr(type(pool), m, None))]


def describe(view: Any) -> dict[str, str]:
    """The engine's pools by role, as the engine holds them: the class of each, and of each part of
    its allocator (an SWA pool's full and SWA allocators)."""
    out: dict[str, str] = {}
    for attr in ENGINE_ATTRS:
        obj = own(view, attr)
        if obj is None:
            continue
        out[attr] = type(obj).__name__
        if attr in ("token_to_kv_pool_allocator", "req_to_token_pool"):
            for key, value in instance_items(obj):
                kind = type(value).__name__
                if value is not obj and ("Allocator" in kind or (attr == "req_to_token_pool" and "Pool" in kind)):
                    out[f"{attr}.{key}"] = kind
    return out


MAMBA_PARTS = ("req_to_token_pool.mamba_pool", "req_to_token_pool.mamba_allocator")


def untracked(pools: dict[str, str], judged: frozenset[str] = frozenset()) -> dict[str, str]:
    """The engine's pools that no ledger counts: the state pools a hybrid request pool holds beside
    its rows (Mamba and short-conv state slots, n-gram tables), by role; `judged` roles aside."""
    return {role: kind for role, kind in pools.items() if role.startswith("req_to_token_pool.") and role not in judged}


def mamba_judged(requests: Any, off: str) -> frozenset[str]:
    """The Mamba state pool's roles where its slots are judged (mamba_slots.py): the request pool's
    own alloc carries that ledger's hook and the ledger has not turned itself off."""
    alloc = getattr(type(requests), "alloc", None) if requests is not None else None
    if off or getattr(alloc, "__kvdoctor_role__", "") != "hybrid_rows_alloc":
        return frozenset()
    return frozenset(MAMBA_PARTS)


class SpeculativeRows:
    """Which speculative algorithm the engine runs, as its objects name it. SGLang builds its pools
    (where the first ledger is made) before any object that names them exists, so the callers of
    the first few allocations are searched (`seeks_left`) until one names it."""

    def __init__(self) -> None:
        self.algorithm: str | None = None  # None: not known yet; '': the engine does not decode speculatively
        self.seeks_left = 0
        self._started = False

    def start(self) -> bool:
        """Once, at the first ledger: search the next allocations' callers. True if searching."""
        if not self._started and self.algorithm is None:
            self._started = True
            self.seeks_left = MAX_SPECULATIVE_SEEKS
        return self.seeks_left > 0

    def note(self, holder: Any) -> bool:
        """Reads the algorithm `holder` names; True when that changes what is known (a speculative
        algorithm, once named, is not taken back by another object naming none)."""
        algorithm = speculative_algorithm(holder)
        if algorithm is None:
            return False
        self.seeks_left = 0
        if algorithm == self.algorithm or (not algorithm and self.algorithm):
            return False
        self.algorithm = algorithm
        return True

    def unseen(self, writers: list[str], launched_in_place: list[str]) -> str:
        return speculative_rows_unseen(self.algorithm, writers, launched_in_place)
