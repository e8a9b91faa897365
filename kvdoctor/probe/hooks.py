"""How the probe gets between the engine and its own methods: roles, wrappers, the import hook.

A versioned map (`probes/*.toml`) says which method plays which *role* ("alloc", "tree_insert",
"vllm_free", ...). Each engine package (`kvdoctor.probe.sglang`, `kvdoctor.probe.vllm`) exports
`ROLES`, a table of `Role` objects; the registry loads that table when the engine's map is
selected. A wrapper calls the host's original method exactly once, with the host's own
arguments (or the ones an optional fix rewrote), and returns its result untouched; the role's
code runs around it in `try` blocks, so a failure turns the probe off and never reaches the host.

Where the compiled hot path is importable (`kvdoctor.probe.hotpath`), the wrapper is its `Hooked`
object: the same steps in C, and the healthy case of the slot roles that declare a `fast_kind`
done there too. `wrap_method` below is the pure-Python wrapper it replaces, kept as the fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from kvdoctor.probe import hotpath
from kvdoctor.probe.maps import ClassHooks

if TYPE_CHECKING:
    from kvdoctor.probe.runtime import Probe

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def argument(args: Args, kwargs: Kwargs, name: str, position: int) -> Any:
    """A host call's argument by name, else by position; None when it was not passed."""
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def positive_ints(obj: Any, *names: str) -> tuple[int, ...]:
    """`obj`'s integer attributes `names`, all > 0, or a TypeError naming what is there instead:
    an engine object without them is one we do not understand."""
    values = tuple(getattr(obj, name, None) for name in names)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(names, values, strict=True))
        raise TypeError(f"{type(obj).__name__} has no usable {'/'.join(names)} ({shown})")
    return values  # type: ignore[return-value]


def resolve(obj: Any, dotted: str) -> Any:
    """`obj.a.b` for "a.b"; None where any step is missing."""
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclasses.dataclass(frozen=True)
class Hook:
    """What the map says about one wrapped method: its role, the ledger it feeds, its class's
    options, and where each argument the role reads is (`positions`: the role's defaults, with the
    map's `args` table where a release moved one)."""

    role: str
    method: str
    ledger: str = ""
    spec: ClassHooks | None = None
    positions: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def options(self) -> dict[str, Any]:
        return self.spec.options if self.spec is not None else {}

    def arg(self, args: Args, kwargs: Kwargs, name: str) -> Any:
        """The host call's argument `name` (by keyword, else at its position); None if not passed."""
        if name in kwargs:
            return kwargs[name]
        position = self.positions.get(name)
        return args[position] if position is not None and len(args) > position else None


class Role:
    """What one kind of hooked call means to a ledger.

    `before` runs ahead of the host's call and returns a context for the others; `after` runs
    once the call returned. `rewrite` and `rewrite_result` run only with an optional fix on.
    `composite` roles compose inside one allocator (free_segment -> free_page_ids -> free): only
    the outermost call on an object is recorded. `wants_site` roles get the call site's id.
    `fast_kind` names the compiled fast path that does this role's healthy case (see hotpath.py).
    """

    fast_kind: ClassVar[str] = ""
    runs_first: ClassVar[bool] = False  # a function role whose work is `before` the call (rare calls: never compiled)
    composite: ClassVar[bool] = False
    wants_site: ClassVar[bool] = False
    ledger: ClassVar[str] = ""  # the ledger it feeds: off unless all its hooks resolve
    reads: ClassVar[dict[str, int]] = {}  # arguments read by name -> default position (self not counted)

    def positions(self, moved: dict[str, int] | None) -> dict[str, int]:
        """Where this role finds its arguments, given a map's `args` entry for the method."""
        return {**self.reads, **(moved or {})}

    def prepare_args(self, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        """Turns one-shot arguments (iterators) into lists that yield the same items, so that the
        role and the host both see them. Only roles that override it pay for the call."""
        return args, kwargs

    def before(self, probe: Probe, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        return site

    def rewrite(self, probe: Probe, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, ctx: Any) -> tuple[Args, Kwargs]:
        """Only with an optional fix on: the arguments the host's method is called with."""
        return args, kwargs

    def after(self, probe: Probe, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        return None

    def finally_(self, probe: Probe, ctx: Any) -> None:
        """Runs even when the host's call raised (undo what `before` set up)."""
        return None

    def rewrite_result(self, probe: Probe, obj: Any, result: Any) -> Any:
        """Only with an optional fix on: what the host's caller receives."""
        return result


class NoteRole(Role):
    """A call that changes no slot's state (a lock, a free group's begin, a merge of staged pages);
    hooked so that a release which renames it is noticed."""


class RoleRegistry:
    """Role name -> Role, filled from each engine package's `ROLES` table when its map is used."""

    def __init__(self) -> None:
        self._roles: dict[str, Role] = {}
        self._loaded: set[str] = set()

    def register(self, name: str, role: Role) -> None:
        known = self._roles.get(name)
        if known is not None and type(known) is not type(role):
            raise ValueError(f"role {name!r} is already {type(known).__name__}, not {type(role).__name__}")
        self._roles[name] = role

    def load(self, engine: str) -> None:
        """Registers `kvdoctor.probe.<engine>.ROLES` (once)."""
        if engine in self._loaded:
            return
        package = importlib.import_module(f"kvdoctor.probe.{engine}")
        for name, role in package.ROLES.items():
            self.register(name, role)
        self._loaded.add(engine)

    def get(self, name: str) -> Role | None:
        return self._roles.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._roles


REGISTRY = RoleRegistry()


class _Current:
    """The probe every wrapper reports to (None: pass through). One attribute read per call, and
    a probe activated again after `deactivate` is reached by the wrappers already in place."""

    probe: Probe | None = None


CURRENT = _Current()


class _ThreadState(threading.local):
    """The Python wrapper's re-entry bookkeeping (the compiled one keeps its own, per thread)."""

    def __init__(self) -> None:
        self.busy: dict[int, int] = {}  # id(obj) -> composite calls in progress
        self.active: set[tuple[int, str]] = set()  # (id(obj), role) in progress: no re-entry


LOCAL = _ThreadState()


def wrap_method(original: Callable[..., Any], role: Role, hook: Hook) -> Callable[..., Any]:
    """The host's method with `role` around it: the compiled wrapper where it is available, else
    `python_wrapper`. See the module docstring for the guarantees."""
    if hotpath.active():
        return hotpath.wrap(original, role, hook)
    return python_wrapper(original, role, hook)


def python_wrapper(original: Callable[..., Any], role: Role, hook: Hook) -> Callable[..., Any]:
    """The pure-Python wrapper: what the compiled one does, step for step."""
    name = hook.role
    ledger = hook.ledger
    composite = role.composite
    wants_site = role.wants_site
    local = LOCAL
    current = CURRENT
    has_finally = type(role).finally_ is not Role.finally_
    prepare = role.prepare_args if type(role).prepare_args is not Role.prepare_args else None

    @functools.wraps(original)
    def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
        probe = current.probe
        if probe is None or not probe.ledger_on or ledger in probe.ledgers_off:
            return original(obj, *args, **kwargs)
        oid = id(obj)
        key = (oid, name)
        active = local.active
        busy = local.busy if composite else None
        if key in active or (busy is not None and busy.get(oid)):
            return original(obj, *args, **kwargs)
        ctx = None
        ok = True
        try:
            probe.py_calls += 1
            if probe.inject and name in probe.inject:
                raise RuntimeError(f"fault injected into the {name} hook")
            site = probe.sites.at(sys._getframe(1)) if wants_site else 0
            if prepare is not None:
                args, kwargs = prepare(args, kwargs)
            ctx = role.before(probe, hook, obj, args, kwargs, site)
        except Exception as exc:
            ok = False
            probe.fail(name, exc)
        fixes_on = bool(probe.fixes)
        call_args, call_kwargs = args, kwargs
        if ok and fixes_on:
            try:
                call_args, call_kwargs = role.rewrite(probe, hook, obj, args, kwargs, ctx)
            except Exception as exc:
                call_args, call_kwargs = args, kwargs
                probe.fix_failed(name, exc)
        active.add(key)
        if busy is not None:
            busy[oid] = busy.get(oid, 0) + 1
        try:
            result = original(obj, *call_args, **call_kwargs)
        finally:
            active.discard(key)
            if busy is not None:
                busy[oid] -= 1
            if ok and has_finally:
                try:
                    role.finally_(probe, ctx)
                except Exception as exc:
                    ok = False
                    probe.fail(name, exc)
        if ok and probe.ledger_on:
            try:
                role.after(probe, hook, obj, args, kwargs, result, ctx)
            except Exception as exc:
                probe.fail(name, exc)
            if fixes_on:
                try:
                    result = role.rewrite_result(probe, obj, result)
                except Exception as exc:
                    probe.fix_failed(name, exc)
        return result

    wrapper.__kvdoctor_role__ = name  # type: ignore[attr-defined]
    return wrapper


def wrap_function(original: Callable[..., Any], role: Role, hook: Hook) -> Callable[..., Any]:
    """A module-level function with `role.after` run on its result (obj is None), or `role.before`
    ahead of the call for a `runs_first` role: compiled where the extension is available."""
    if hotpath.active() and not role.runs_first:
        return hotpath.wrap_function(original, role, hook)
    current = CURRENT

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if role.runs_first:
            probe = current.probe
            if probe is not None and probe.ledger_on and hook.ledger not in probe.ledgers_off:
                try:
                    role.before(probe, hook, None, args, kwargs, 0)
                except Exception as exc:
                    probe.fail(hook.role, exc)
        result = original(*args, **kwargs)
        probe = current.probe
        if probe is not None and probe.ledger_on and hook.ledger not in probe.ledgers_off:
            try:
                role.after(probe, hook, None, args, kwargs, result, None)
            except Exception as exc:
                probe.fail(hook.role, exc)
        return result

    wrapper.__kvdoctor_role__ = hook.role  # type: ignore[attr-defined]
    return wrapper


def rebind_imported(original: Callable[..., Any], wrapped: Callable[..., Any], prefixes: tuple[str, ...]) -> None:
    """Modules that did `from x import f` before we patched x still hold the original."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace or not getattr(module, "__name__", "").startswith(prefixes):
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                try:
                    setattr(module, attr, wrapped)
                except Exception:
                    pass


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then lets the probe patch the fresh module."""

    def __init__(self, inner: importlib.abc.Loader, on_loaded: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.on_loaded = on_loaded

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.on_loaded(module)


class ImportHook(importlib.abc.MetaPathFinder):
    """Finds the modules a map names as they are imported, and patches each once loaded."""

    def __init__(self, modules: set[str], on_loaded: Callable[[ModuleType], None]) -> None:
        self.modules = modules
        self.on_loaded = on_loaded

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self.on_loaded)
                return spec
        return None

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
