"""How the probe gets between the engine and its own methods: roles, wrappers, the import hook.

A versioned map (`probes/*.toml`) says which method plays which *role* ("alloc", "tree_insert",
"vllm_free", ...). Each engine package (`kvdoctor.probe.engines.sglang`, `kvdoctor.probe.engines.vllm`) exports
`ROLES`, a table of `Role` objects (`Role` and `Hook` are in `context.py`, beside what a role
may use of the probe); the registry loads that table when the engine's map is selected. A
wrapper calls the host's original method exactly once, with the host's own arguments (or the
ones an optional fix rewrote), and returns its result untouched; the role's code runs around it
in `try` blocks, so a failure turns the probe off and never reaches the host.

Where the native path is importable (`kvdoctor.probe.native`), the wrapper is its `Hooked`
object: the same steps in C, and the healthy case of the slot roles that declare a `fast_kind`
done there too. `wrap_method` below is the pure-Python wrapper it replaces, kept as the fallback.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvdoctor.probe import native
from kvdoctor.probe.base.context import Hook, Role

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


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
        package = importlib.import_module(f"kvdoctor.probe.engines.{engine}")
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

    probe: ProbeContext | None = None


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
    if native.active():
        return native.wrap(original, role, hook)
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
    if native.active() and not role.runs_first:
        return native.wrap_function(original, role, hook)
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
