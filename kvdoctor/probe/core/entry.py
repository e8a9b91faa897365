"""The probe's way into a process of an environment kvdoctor is installed in, whatever its PYTHONPATH.

The wheel puts `kvdoctor-autoprobe.pth` in site-packages (setup.py writes it): every interpreter of
that environment reads it at start-up, and it imports this module only where `kvdoctor run` or
`gate` set KVDOCTOR_AUTOPROBE, as coverage.py's start-up hook measures subprocesses. So a server
started by a script that replaced PYTHONPATH (`export PYTHONPATH=<its dir>`), which drops the
sitecustomize `run` put there (kvdoctor/delivery/pythonpath), is still probed. What this does is what that
sitecustomize does: wait for an engine's top-level package and turn the probe on then (at once
with attribution asked for); where both run, the probe starts once (`runtime.activate` is
idempotent, and the sitecustomize leaves the watch to this one). Nothing here may fail the host.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV_AUTOPROBE = "KVDOCTOR_AUTOPROBE"  # set by `kvdoctor run`/`gate` for the command's processes
ENGINE_PACKAGES = ("sglang", "vllm")  # as kvdoctor/delivery/pythonpath/sitecustomize.py's (a test holds them equal)
_OFF = ("", "0", "false", "no", "off")  # KVDOCTOR_ATTRIBUTION: not asked for (as the sitecustomize reads it)
_ON = ("1", "true", "yes", "on")  # KVDOCTOR_DISABLE: disabled (as settings.py and the sitecustomize read it)


def _activate() -> None:
    try:
        from kvdoctor.probe.core import runtime

        runtime.activate()
    except Exception:
        pass


class _ProbeFirst:
    """The engine's own loader, turning the probe on just before the engine's first module runs.

    Not in find_spec: the import system calls finders holding its global import lock, and the
    probe's own imports made there wait on every other thread's import while one of those may wait
    on them (a thread a sitecustomize started, importing `json`, hung servers at start-up so)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # is_package, get_code, get_resource_reader: the engine's loader's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:  # the module keeps its own loader
            if getattr(module.__spec__, "loader", None) is self:
                module.__spec__.loader = self.inner
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.inner
        except Exception:
            pass
        _activate()
        self.inner.exec_module(module)


class EngineWatch:
    """Turns the probe on as an engine's top-level package is first imported, then steps aside:
    finds the engine's spec with the finders after it and hands it back with a loader that starts
    the probe first (one with no exec_module: the probe starts here, as it did before)."""

    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> Any:
        if path is not None or name not in ENGINE_PACKAGES:
            return None
        try:
            sys.meta_path.remove(cls)
        except ValueError:
            pass
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                spec = find(name, path, target) if find is not None else None
                if spec is None:
                    continue
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ProbeFirst(spec.loader)
                    return spec
                break
            else:
                return None  # the engine is not installed: nothing to probe
        except Exception:
            return None  # the import goes on as if the probe were not here
        _activate()
        return None


def start() -> None:
    try:
        if not os.environ.get(ENV_AUTOPROBE) or os.environ.get("KVDOCTOR_DISABLE", "").strip().lower() in _ON:
            return
        if os.environ.get("KVDOCTOR_ATTRIBUTION", "").strip().lower() not in _OFF:
            _activate()
        elif EngineWatch not in sys.meta_path:
            sys.meta_path.insert(0, EngineWatch)
    except Exception:
        pass


start()
