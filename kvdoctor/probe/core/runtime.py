"""The probe in one process: its state, the maps in force, and turning it on and off.

`activate()` installs an import hook for every module a shipped map names and patches those
already imported. When the first of an engine's modules loads, the map for the installed version
of that engine is selected and its roles loaded; a version without a map leaves the process
untouched and says so. Engine knowledge lives in the maps (`probes/`) and the engine packages
(`kvdoctor.probe.engines.sglang`, `kvdoctor.probe.engines.vllm`); nothing here is specific to one engine.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

from kvdoctor.probe import native
from kvdoctor.probe.base.callsites import CallSites, short_path
from kvdoctor.probe.base.context import EngineState, ProbeContext, StateT
from kvdoctor.probe.base.emitter import Emitter, say
from kvdoctor.probe.base.settings import DAY_S, env_number, env_switch
from kvdoctor.probe.base.shutdown import Rendezvous
from kvdoctor.probe.core.hooks import CURRENT, ImportHook
from kvdoctor.probe.core.patching import Patcher, still_importing
from kvdoctor.probe.maps.loader import ProbeMap, available_maps
from kvdoctor.trace import schema

ENV_TRACE = "KVDOCTOR_TRACE"
ENV_FIXES = "KVDOCTOR_FIXES"
ENV_INJECT = "KVDOCTOR_INJECT_FAULT"  # tests only: make named roles raise
ENV_DISABLE = "KVDOCTOR_DISABLE"
ENV_IDLE_CENSUS_INTERVAL_S = "KVDOCTOR_IDLE_CENSUS_INTERVAL_S"
ENV_WRITER_INTERVAL_S = "KVDOCTOR_WRITER_INTERVAL_S"  # the writer thread's rounds (0.5 s); benchmarks stretch it
FIXES_DESCRIBED = 16  # fix_applied events with evidence per fix; then counts only


class Probe:
    """One per process: the emitter, the call sites, the engine states, and the maps in force and
    the hooks installed (`patching`, a `Patcher`).

    `ledger_on`, `fixes`, `inject` and `ledgers_off` are the switches every wrapper reads; the
    compiled wrappers read a copy, refreshed whenever one is set (so set them, do not mutate them,
    and switch ledgers off with `switch_off_ledgers`)."""

    def __init__(self, trace_path: str | None, *, fixes: list[str] | None = None, inject: set[str] | None = None) -> None:
        self.trace_path = trace_path
        self._fixes = list(fixes or [])
        self._inject = set(inject or ())
        self.emitter = Emitter(
            trace_path,
            flush_interval_s=env_number(ENV_WRITER_INTERVAL_S, 0.5, low=0.01, high=3600.0),  # 1e-9 would spin a core
            header_args={"engine": "", "engine_version": "", "probe": "kvdoctor", **native.CHOICE.header()},
        )
        self.sites = CallSites()
        self.serving_marked = False
        self._ledger_on = True
        self.off_reason = ""
        self.ledgers_off: frozenset[str] = frozenset()
        self.patching = Patcher(self)
        self.py_calls = 0  # hooked calls through the Python wrapper
        self._native_calls_base = native.calls()
        self.failures = 0
        self.fix_counts: dict[str, int] = {}
        self._fix_unreported: dict[str, int] = {}
        self.states: dict[str, EngineState] = {}
        # An idle census reads a whole ledger back: at most one per interval (and one at exit).
        self.idle_census_interval_s = env_number(ENV_IDLE_CENSUS_INTERVAL_S, 2.0, high=DAY_S)
        self._closed = False
        self.rendezvous = Rendezvous.from_env()  # under `kvdoctor run`: the census asked for at shutdown
        self.emitter.periodic.append(self._periodic)

    # ----- the maps and hooks (`core.patching`) -----

    @property
    def maps(self) -> dict[str, ProbeMap | None]:
        return self.patching.maps

    @property
    def map_notes(self) -> dict[str, str]:
        return self.patching.map_notes

    @property
    def versions(self) -> dict[str, str]:
        return self.patching.versions

    @property
    def patched(self) -> list[str]:
        return self.patching.patched

    @property
    def missing(self) -> list[str]:
        return self.patching.missing

    def version_of(self, engine: str) -> str:
        return self.patching.versions.get(engine, "")

    def on_module_loaded(self, module: ModuleType) -> None:
        self.patching.on_module_loaded(module)

    # ----- the switches every wrapper reads -----

    def _switched(self) -> None:
        if CURRENT.probe is self:
            native.sync(self)

    @property
    def ledger_on(self) -> bool:
        return self._ledger_on

    @ledger_on.setter
    def ledger_on(self, value: bool) -> None:
        self._ledger_on = bool(value)
        self._switched()

    @property
    def fixes(self) -> list[str]:
        return self._fixes

    @fixes.setter
    def fixes(self, value: list[str]) -> None:
        self._fixes = list(value)
        self._switched()

    @property
    def inject(self) -> set[str]:
        return self._inject

    @inject.setter
    def inject(self, value: set[str]) -> None:
        self._inject = set(value)
        self._switched()

    def switch_off_ledgers(self, names: Any) -> None:
        self.ledgers_off = self.ledgers_off | frozenset(names)
        self._switched()

    @property
    def calls(self) -> int:
        """Hooked calls recorded in this process, through either wrapper."""
        return self.py_calls + native.calls() - self._native_calls_base

    def state(self, key: str, factory: Callable[[ProbeContext], StateT]) -> StateT:
        """The engine state under `key`, made on first use."""
        found = self.states.get(key)
        if found is None:
            found = self.states[key] = factory(self)
        return found  # type: ignore[return-value]

    # ----- status -----

    def status(self, state: str, reason: str, **extra: Any) -> None:
        self.emitter.emit(schema.PROBE_STATUS, {"component": "ledger", "state": state, "reason": reason, **extra})

    def mark_serving(self, reason: str) -> None:
        """Once, from the writer thread: the engine took its first request, the end of its start-up
        for the memory growth tests (kvdoctor.analysis.serving_start; `patching` said it would)."""
        if not self.serving_marked:
            self.serving_marked = True
            self.emitter.emit(schema.PROBE_STATUS, {"component": schema.SERVING, "state": "on", "reason": reason})

    def fixed(self, fix: str, count: int = 1, **evidence: Any) -> None:
        """A fix changed the host's behaviour: counted, and the first few occurrences described."""
        total = self.fix_counts.get(fix, 0)
        self.fix_counts[fix] = total + count
        if total < FIXES_DESCRIBED:
            self.emitter.emit(schema.FIX_APPLIED, {"fix": fix, "count": count, **evidence})
        else:
            self._fix_unreported[fix] = self._fix_unreported.get(fix, 0) + count

    def fix_failed(self, role: str, exc: BaseException) -> None:
        """A fix that cannot apply is dropped; the host's call proceeds unfixed."""
        self.fixes = []
        self.status("partial", f"fixes turned off after {type(exc).__name__} in the {role} fix: {exc}")

    def fail(self, role: str, exc: BaseException) -> None:
        """Our own bug or a host we do not understand: stop feeding the ledgers, say why."""
        self.failures += 1
        if not self.ledger_on:
            return
        self.ledger_on = False
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" at {short_path(where[0].filename)}:{where[0].lineno}" if where else ""
        self.off_reason = f"{type(exc).__name__} in the {role} hook{at}: {exc}"
        self.status("off", self.off_reason + "; the server's calls go on untouched, ledger findings stop here")

    def turn_off_ledger(self, ledger: str, what: str, reason: object) -> None:
        """One ledger off, said once as the probe partial: `what` is off because of `reason`; the
        server's calls and the other ledgers go on."""
        if ledger in self.ledgers_off:
            return
        self.switch_off_ledgers({ledger})
        self.emitter.emit(
            schema.PROBE_STATUS,
            {
                "component": "ledger",
                "state": "partial",
                "ledger": ledger,
                "reason": f"{what} is off: {reason}; the server's calls go on untouched, the KV ledgers are unaffected",
            },
        )

    def turn_off(self, reason: str) -> None:
        """No map for this engine (or none of its ledgers left): the probe stays out, said once."""
        self.ledger_on = False
        self.off_reason = reason
        self.status("off", reason + "; the probe stays out of this process and the server runs untouched")
        say(reason + "; the probe stays out of this process")

    def ledger_is_on(self, ledger: str) -> bool:
        """Whether a ledger may be fed and read: the probe is on and all the ledger's hooks resolved."""
        return self.ledger_on and ledger not in self.ledgers_off

    def stats(self) -> dict[str, Any]:
        return {"hooked_calls": self.calls, "probe_failures": self.failures, **self.emitter.stats()}

    # ----- the writer thread's round, and the end -----

    def _periodic(self) -> None:
        if self.ledger_on:
            try:
                self.patching.sweep()
            except Exception as exc:
                self.fail("patch", exc)
        for fix, count in list(self._fix_unreported.items()):
            if count:
                self._fix_unreported[fix] = 0
                self.emitter.emit(schema.FIX_APPLIED, {"fix": fix, "count": count})
        for key, state in list(self.states.items()):
            if not self.ledger_on:
                break
            try:
                state.periodic(self)
            except Exception as exc:
                self.fail(f"{key} periodic", exc)
        self._answer_shutdown_request()
        self.emitter.counter(schema.PROBE_STATS, self.stats())

    def _answer_shutdown_request(self) -> None:
        """The launcher is about to kill this process: each engine state takes its census when it
        can (None: not yet, ask again next round), and the launcher is told."""
        rendezvous = self.rendezvous
        if rendezvous is None or not rendezvous.asked():
            return
        if not self.ledger_on:
            rendezvous.answer("none", reason=f"the probe is off: {self.off_reason}")
            return
        answers: dict[str, Any] = {}
        for key, state in list(self.states.items()):
            take = getattr(state, "census_at_shutdown", None)
            if take is None:
                continue
            try:
                answer = take(self, rendezvous.waited_s())
            except Exception as exc:
                self.fail(f"{key} shutdown census", exc)
                answer = {"census": "none"}
            if answer is None:
                return
            answers[key] = answer
        census = ",".join(sorted({str(a.get("census")) for a in answers.values()})) or "none"
        self.emitter.flush()  # in the trace before the answer: the kill follows it at once
        rendezvous.answer(census, waited_s=round(rendezvous.waited_s(), 3), engines=answers)

    def shutdown(self, reason: str = "exit") -> None:
        if self._closed:
            return
        self._closed = True
        if not self.maps and not self.states and not self.emitter.buffer and not self.emitter.header_written:
            return  # this process never met an engine: it leaves no trace at all
        try:
            self._periodic()
            for key, state in list(self.states.items()):
                try:
                    state.close(self, reason)
                except Exception as exc:
                    self.fail(f"{key} close", exc)
            self.emitter.counter(schema.PROBE_STATS, self.stats())
        finally:
            self.emitter.close()
            if self.rendezvous is not None:
                self.rendezvous.answer(reason)  # written: a process that exits by itself needs no wait


_IMPORT_HOOK: ImportHook | None = None


def current() -> Probe | None:
    # CURRENT holds the probe as the wrappers see it (a ProbeContext); only `activate` sets it, to a Probe
    return cast("Probe | None", CURRENT.probe)


def activate(trace_path: str | None = None, *, fixes: list[str] | None = None) -> Probe | None:
    """Turns the probe on in this process (idempotent). Never raises."""
    global _IMPORT_HOOK
    if CURRENT.probe is not None:
        return current()
    try:
        if env_switch(ENV_DISABLE, False):
            return None
        trace_path = trace_path or os.environ.get(ENV_TRACE)
        if fixes is None:
            fixes = [f for f in os.environ.get(ENV_FIXES, "").split(",") if f]
        inject = {r for r in os.environ.get(ENV_INJECT, "").split(",") if r}
        probe = Probe(trace_path, fixes=fixes, inject=inject)
        modules: set[str] = set()
        for probe_map in available_maps():
            modules |= probe_map.modules()
        _IMPORT_HOOK = ImportHook(modules, probe.on_module_loaded)
        _IMPORT_HOOK.install()
        CURRENT.probe = probe
        native.sync(probe)

        for name in sorted(modules):
            module = sys.modules.get(name)
            if module is not None and not still_importing(module):
                probe.on_module_loaded(module)
        try:
            from kvdoctor.probe.readings import attribution_start

            attribution_start.start_if_enabled(probe)
        except Exception:
            pass
        atexit.register(probe.shutdown)
        try:
            from multiprocessing import util

            util.Finalize(None, probe.shutdown, exitpriority=100)
        except Exception:
            pass
        return probe
    except Exception:
        return None


def deactivate() -> None:
    """Ends the probe in this process (tests; `kvdoctor demo`). Patched methods become pass-throughs."""
    global _IMPORT_HOOK
    probe = current()
    if probe is None:
        return
    probe.shutdown()
    probe.ledger_on = False
    if _IMPORT_HOOK is not None:
        _IMPORT_HOOK.remove()
        _IMPORT_HOOK = None
    CURRENT.probe = None
    native.reset()
