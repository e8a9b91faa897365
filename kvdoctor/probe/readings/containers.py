"""The sizes of the engine's own containers, by name: lists, dicts, sets and deques that only grow.

Some leaks are not in the KV pool at all but in the bookkeeping around it: a list appended on
every allocation and drained only for one kind of model (vllm#44490, vLLM 0.22:
`SingleTypeKVCacheManager.new_block_ids`), a dict of per-request data never popped (vllm#17567,
`Scheduler._cached_reqs_data`). Host memory grows with the requests served while live requests
stay flat, and `gc.freeze()` hides the objects from gc and tracemalloc. Their names are one walk
away from the objects the probe already hooks.

So the writer thread walks, every `KVDOCTOR_CONTAINERS_PERIOD_S` (5 s), from each root the engine
roles hand over (vLLM's KVCacheManager): instance attributes only (`vars()`; never a property,
never a method call), into objects of the engine's own classes (their module is the engine's
package), the first items of lists, tuples and dict values that are such objects, and records
the `len()` of every list, dict, set and deque met, by attribute path
(`coordinator.single_type_managers[0].new_block_ids`). The walk is bounded (`MAX_NODES` objects,
`MAX_DEPTH` attributes deep, `MAX_PATHS` paths, the first found kept: the walk's order is the
attributes' order, the same from one walk to the next), reads nothing on the GPU and takes the
GIL for a few milliseconds at most. Each walk is one `container_sizes` event, with the live
requests and the allocations served so far beside it, and the pool's block count as the bound a
block-keyed cache cannot outgrow: the `container_growth` detector reads them.

A walk that raises turns the walk off with one `probe_status` line (component "containers");
`KVDOCTOR_CONTAINERS=0` turns it off.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.objects import instance_items
from kvdoctor.probe.base.settings import env_positive, env_switch
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

ENV_CONTAINERS = "KVDOCTOR_CONTAINERS"
ENV_PERIOD_S = "KVDOCTOR_CONTAINERS_PERIOD_S"
DEFAULT_PERIOD_S = 5.0
MAX_ROOTS = 8
MAX_NODES = 2000  # objects visited per root and walk
MAX_DEPTH = 5  # attributes followed from a root
MAX_ITEMS = 8  # items of one list or dict looked into for engine objects
MAX_PATHS = 256  # containers reported per root

CONTAINER_TYPES = (list, dict, set, frozenset, collections.deque)
STATE_KEY = "containers"


def walk_sizes(root: Any, package: str) -> dict[str, int]:
    """`{attribute path: len}` of the containers reachable from `root` through objects whose class
    lives in `package` (e.g. "vllm."), breadth first, bounded as the module says."""
    sizes: dict[str, int] = {}
    seen: set[int] = {id(root)}
    frontier: list[tuple[str, Any]] = [("", root)]
    visited = 0
    for depth in range(MAX_DEPTH):
        following: list[tuple[str, Any]] = []
        for path, obj in frontier:
            visited += 1
            if visited > MAX_NODES:
                return sizes
            attrs = _attributes(obj)
            for name, value in attrs:
                child = f"{path}.{name}" if path else name
                _visit(child, value, package, sizes, seen, following)
                if len(sizes) >= MAX_PATHS:
                    return sizes
        if not following or depth + 1 == MAX_DEPTH:
            break
        frontier = following
    return sizes


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """The instance's own attributes (read by name, without CPython building its `__dict__`: see
    objects.py) and its `__slots__`; nothing that runs the engine's code."""
    found: list[tuple[str, Any]] = []
    try:
        found.extend(instance_items(obj))
    except Exception:
        pass
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                descriptor = cls.__dict__.get(name)
                if descriptor is not None and type(descriptor).__name__ == "member_descriptor":
                    try:
                        found.append((name, descriptor.__get__(obj, type(obj))))
                    except AttributeError:
                        pass
    return found


def _visit(path: str, value: Any, package: str, sizes: dict[str, int], seen: set[int], following: list[tuple[str, Any]]) -> None:
    if isinstance(value, CONTAINER_TYPES):
        sizes[path] = len(value)
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            items = list(value.values())[:MAX_ITEMS] if len(value) <= 1_000_000 else []
            named = False
        elif isinstance(value, (list, collections.deque)):
            items = list(value)[:MAX_ITEMS] if isinstance(value, list) else [value[i] for i in range(min(MAX_ITEMS, len(value)))]
            named = True
        else:
            return
        for index, item in enumerate(items):
            if _is_engine_object(item, package) and id(item) not in seen:
                seen.add(id(item))
                following.append((f"{path}[{index}]" if named else f"{path}[*]", item))
        return
    if isinstance(value, tuple):
        for index, item in enumerate(value[:MAX_ITEMS]):
            if _is_engine_object(item, package) and id(item) not in seen:
                seen.add(id(item))
                following.append((f"{path}[{index}]", item))
        return
    if _is_engine_object(value, package) and id(value) not in seen:
        seen.add(id(value))
        following.append((path, value))


def _is_engine_object(value: Any, package: str) -> bool:
    module = getattr(type(value), "__module__", "") or ""
    return isinstance(module, str) and module.startswith(package)


class ContainerSizes:
    """Per process: the roots to walk and the walk's schedule (an EngineState: `periodic` runs on
    the writer thread)."""

    def __init__(self, probe: ProbeContext) -> None:
        self.roots: dict[int, tuple[str, str, Any, Callable[[], dict[str, int]]]] = {}
        self.enabled = env_switch(ENV_CONTAINERS, True)
        self.period_s = max(0.05, env_positive(ENV_PERIOD_S, DEFAULT_PERIOD_S))
        self.last_walk = -1e18

    def watch(self, label: str, root: Any, package: str, context: Callable[[], dict[str, int]]) -> None:
        """Walk from `root` (named `label`) at every period; `context()` gives the figures emitted
        beside its sizes (live requests, allocations so far, the pool's blocks)."""
        if self.enabled and id(root) not in self.roots and len(self.roots) < MAX_ROOTS:
            self.roots[id(root)] = (label, package, root, context)

    def periodic(self, probe: ProbeContext) -> None:
        if not self.enabled or not self.roots or probe.emitter.closing:
            return
        now = time.monotonic()
        if now - self.last_walk < self.period_s:
            return
        self.last_walk = now
        self.walk(probe)

    def walk(self, probe: ProbeContext) -> None:
        try:
            for label, package, root, context in list(self.roots.values()):
                sizes = walk_sizes(root, package)
                probe.emitter.emit(schema.CONTAINER_SIZES, {"root": label, "sizes": sizes, **context()})
        except Exception as exc:
            self.enabled = False
            probe.emitter.emit(
                schema.PROBE_STATUS,
                {
                    "component": "containers",
                    "state": "off",
                    "reason": f"the container walk failed ({type(exc).__name__}: {exc}); container sizes are off",
                },
            )

    def close(self, probe: ProbeContext, reason: str) -> None:
        if self.enabled and self.roots:
            self.walk(probe)  # the last sizes, at exit


def sizes_state(probe: ProbeContext) -> ContainerSizes:
    return probe.state(STATE_KEY, ContainerSizes)
