"""Which map a process runs under, and the hooks it installs: the `Probe`'s part that meets the
engine's code, held by it (`Probe.patching`).

The first of an engine's modules to load selects the map for the installed release (the one
tested for it, else the nearest whose hooks resolve, with the ledgers whose hooks do not switched
off and said); each mapped class or function is then checked against the live code and wrapped.
A hook that is not what the map says switches its ledger off, never the server.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

from kvdoctor.probe.base.context import Hook
from kvdoctor.probe.base.emitter import Emitter, say
from kvdoctor.probe.core.hooks import REGISTRY, rebind_imported, wrap_function, wrap_method
from kvdoctor.probe.core.verify import check_signature, describe_choice, nearest_resolving_map
from kvdoctor.probe.maps.loader import ClassHooks, ProbeMap, installed_version, known_versions, map_for
from kvdoctor.probe.maps.releases import ci_sentence
from kvdoctor.trace import schema

ENGINE_LABELS = {"sglang": "SGLang", "vllm": "vLLM"}


class PatchedProbe(Protocol):
    """What the patcher uses of the probe that holds it (`runtime.Probe`)."""

    emitter: Emitter
    ledgers_off: frozenset[str]

    def status(self, state: str, reason: str, **extra: Any) -> None: ...

    def switch_off_ledgers(self, names: Any) -> None: ...

    def fail(self, role: str, exc: BaseException) -> None: ...

    def turn_off(self, reason: str) -> None: ...


class Patcher:
    """The maps in force and the hooks installed, for the one probe that holds it (`Probe.patching`)."""

    def __init__(self, probe: PatchedProbe) -> None:
        self.probe = probe
        self.maps: dict[str, ProbeMap | None] = {}
        self.map_notes: dict[str, str] = {}
        self.versions: dict[str, str] = {}
        self.patched_modules: set[str] = set()
        self.patched: list[str] = []
        self.missing: list[str] = []

    def version_of(self, engine: str) -> str:
        return self.versions.get(engine, "")

    def select_map(self, engine: str) -> ProbeMap | None:
        """The map for the installed release of `engine`: the one tested for it, else the nearest
        one whose hooks resolve in the installed sources. Ledgers whose hooks do not all resolve
        stay off; with none left on (or no map at all) the probe stays out of this process."""
        if engine in self.maps:
            return self.maps[engine]
        version = installed_version(engine)
        self.versions[engine] = version
        if not self.probe.emitter.header_args.get("engine"):
            self.probe.emitter.header_args["engine"] = engine
            self.probe.emitter.header_args["engine_version"] = version
            # an engine's process: its start-up lasts until it first serves (`mark_serving`)
            self.probe.emitter.emit(
                schema.PROBE_STATUS,
                {"component": schema.SERVING, "state": "starting", "reason": f"{engine} imported: starting until its first request"},
            )
        label = f"{ENGINE_LABELS.get(engine, engine)} {version or '(version unreadable)'}"
        tested = map_for(engine, version)
        if tested is not None:
            # Tested on this release: each hook is still checked against the live code as it is wrapped.
            REGISTRY.load(engine)
            self.maps[engine] = tested
            ci = ci_sentence(engine, version)
            if ci.startswith("not tested"):
                self.map_notes[engine] = f"{label}: map {tested.source}, {ci}"
                self.probe.status("on", self.map_notes[engine], map=tested.source)
                say(self.map_notes[engine])
            return tested
        check = nearest_resolving_map(engine, version)
        probe_map = check.probe_map if check is not None else None
        self.maps[engine] = probe_map
        if check is None or probe_map is None:
            self.probe.turn_off(
                f"{label}: kvdoctor has no map for {ENGINE_LABELS.get(engine, engine)} (it knows {', '.join(known_versions(engine))})"
            )
            return None
        off = check.ledgers_off()
        self.probe.switch_off_ledgers(off)
        ci = ci_sentence(engine, version)
        self.map_notes[engine] = describe_choice(label, check) + (f"; {ci}" if ci else "")
        if off and set(off) >= set(check.ledgers()):
            self.probe.turn_off(self.map_notes[engine])
            return None
        self.probe.status("partial" if off else "on", self.map_notes[engine], map=probe_map.source, ledgers_off=sorted(off))
        say(self.map_notes[engine])
        return probe_map

    def patch_module(self, module: ModuleType) -> None:
        name = module.__name__
        engine = name.split(".", 1)[0]
        probe_map = self.select_map(engine)
        if probe_map is None or name in self.patched_modules:
            return
        self.patched_modules.add(name)
        for spec in probe_map.classes:
            if spec.module != name:
                continue
            cls = getattr(module, spec.cls, None)
            for method, role_name in spec.methods.items():
                original = cls.__dict__.get(method) if cls is not None else None

                def patch(wrapped: Callable[..., Any], cls: Any = cls, method: str = method) -> None:
                    setattr(cls, method, wrapped)

                self._hook(f"{spec.cls}.{method}", original, role_name, spec, method, patch)
        for fn_spec in probe_map.functions:
            if fn_spec.module != name:
                continue
            original = getattr(module, fn_spec.function, None)

            def install(wrapped: Callable[..., Any], original: Any = original, fn: str = fn_spec.function) -> None:
                setattr(module, fn, wrapped)
                rebind_imported(original, wrapped, (engine,))

            self._hook(f"{name}.{fn_spec.function}", original, fn_spec.role, None, fn_spec.function, install)
        label = ENGINE_LABELS.get(probe_map.engine, probe_map.engine)
        self.probe.status(
            "on" if not self.missing else "partial",
            f"{label} {self.version_of(engine)} ({probe_map.source}): {len(self.patched)} methods hooked"
            + (f"; not hooked: {', '.join(self.missing)}" if self.missing else "")
            + (f"; ledgers off: {', '.join(sorted(self.probe.ledgers_off))}" if self.probe.ledgers_off else ""),
            map=probe_map.source,
        )

    def _hook(
        self, where: str, original: Any, role_name: str, spec: ClassHooks | None, method: str, install: Callable[[Callable[..., Any]], None]
    ) -> None:
        """Wraps one method or function, after checking it is what the map says it is; a hook
        that is not switches its ledger off (said once, with the reason)."""
        role = REGISTRY.get(role_name)
        if role is None:
            self.missing.append(f"{where} (role {role_name!r} unknown)")
            return
        if role.ledger in self.probe.ledgers_off or getattr(original, "__kvdoctor_role__", None):
            return
        hook = Hook(role_name, method, role.ledger, spec, role.positions(spec.args.get(method) if spec else None))
        problem = "not found" if original is None else check_signature(original, hook.positions, method=spec is not None)
        if problem:
            self.missing.append(f"{where} ({problem})")
            self.probe.switch_off_ledgers([role.ledger])
            reason = f"the {role.ledger} ledger is off: {where} {problem}"
            self.probe.status("partial", reason, ledgers_off=sorted(self.probe.ledgers_off))
            say(reason)
            return
        install(wrap_method(original, role, hook) if spec is not None else wrap_function(original, role, hook))
        self.patched.append(where)

    def on_module_loaded(self, module: ModuleType) -> None:
        try:
            self.patch_module(module)
            self.sweep()
        except Exception as exc:
            self.probe.fail("patch", exc)

    def sweep(self) -> None:
        """Patches mapped modules that were loaded without passing through our import hook (another
        package's import hook in front of ours loaded them): a ledger must not miss their calls."""
        for probe_map in list(self.maps.values()):
            if probe_map is None:
                continue
            for name in sorted(probe_map.modules() - self.patched_modules):
                module = sys.modules.get(name)
                if module is not None and not still_importing(module):
                    self.patch_module(module)


def still_importing(module: ModuleType) -> bool:
    """A module whose body is still running (it imported the one that just loaded): its classes
    may not exist yet, so it is patched once it is complete."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))
