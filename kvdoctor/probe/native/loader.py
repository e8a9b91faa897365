"""Which path this process's hooks run, and why: the native path (the `_native` extension, built with
the package where a C compiler is present) or the pure-Python path, several times the cost per hooked
call. The extension is optional, so its absence must never be silent: `kvdoctor probes`, the first
line `kvdoctor run` prints and every probed process's trace header name the path and the reason
(`KVDOCTOR_NATIVE=0` is set; never built; its build failed, as setup.py noted beside the package;
built for another Python; it does not load here).

`KVDOCTOR_NATIVE` may also name a build of the extension to load in place of the package's own
(CI runs its sanitizer build that way). Nothing here raises.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from kvdoctor.probe.base.settings import env_name, env_text
from kvdoctor.probe.base.vocabulary import FREE, OWNED, RESERVED, TREE

ENV_NATIVE = "KVDOCTOR_NATIVE"
MODULE = "kvdoctor.probe.native._native"
BUILD_ERROR_NOTE = "_native.build-error"  # setup.py writes it beside the package where the build failed
OFF = ("0", "off", "false", "no")
ON = ("", "1", "on", "true", "yes")
HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class NativeChoice:
    """`compiled`: whether hooked calls run in C; `reason`: the build in use, or why none is."""

    compiled: bool
    reason: str

    @property
    def name(self) -> str:
        return "compiled" if self.compiled else "python"

    def header(self) -> dict[str, str]:
        """What a probed process's trace header records of it."""
        return {"native_path": self.name, "native_path_reason": self.reason}

    def describe(self) -> str:
        """One line, e.g. `compiled (kvdoctor/probe/native/_native....so)` or `pure Python: KVDOCTOR_NATIVE=0 is set`."""
        return f"compiled ({self.reason})" if self.compiled else f"pure Python: {self.reason}"


def load() -> tuple[ModuleType | None, NativeChoice]:
    """The extension to use (None: the Python path), and the choice as it is to be said."""
    name = env_name(ENV_NATIVE)  # KVDOCTOR_HOTPATH, its old name, still works
    asked = env_text(ENV_NATIVE)
    if asked.lower() in OFF:
        return None, NativeChoice(False, f"{name}={asked} is set")
    try:
        if asked.lower() in ON:
            module: Any = importlib.import_module(MODULE)
            if getattr(module, "__file__", None) is None:  # a folder of that name, not the extension
                return None, NativeChoice(False, _why_not_built())
            where = os.path.relpath(str(module.__file__), os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
        else:
            module, where = _load_file(name, asked), asked
        vocabulary = tuple(getattr(module, name, None) for name in ("FREE", "OWNED", "TREE", "RESERVED"))
    except ModuleNotFoundError as exc:
        if exc.name != MODULE:
            return None, NativeChoice(False, f"the native path does not load: {exc}")
        return None, NativeChoice(False, _why_not_built())
    except Exception as exc:
        return None, NativeChoice(False, f"the native path does not load here: {type(exc).__name__}: {exc}")
    if vocabulary != (FREE, OWNED, TREE, RESERVED):  # never mix two ledger vocabularies
        return None, NativeChoice(False, f"{where} was built from another ledger vocabulary: reinstall kvdoctor to rebuild it")
    return module, NativeChoice(True, where)


def _load_file(name: str, path: str) -> ModuleType:
    """The extension built at `path` (a sanitizer build, say), under the package's own name."""
    if not os.path.isfile(path):
        raise ImportError(f"{name}={path}: no such file (0 turns the native path off, 1 or unset uses the package's)")
    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.machinery.ModuleSpec(MODULE, loader, origin=path)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[MODULE] = module
    return module


def _why_not_built() -> str:
    try:
        with open(os.path.join(HERE, BUILD_ERROR_NOTE)) as fh:
            failure = fh.read().strip()[:300]
        return f"the native path failed to build when kvdoctor was installed ({failure}); reinstall it with `pip install -v` to see the compiler's errors"
    except OSError:
        pass
    try:
        others = sorted(f for f in os.listdir(HERE) if f.startswith("_native.") and f.endswith((".so", ".pyd")))
    except OSError:
        others = []
    if others:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return (
            f"the native path was built for another Python ({', '.join(others)}), not this {version}: reinstall kvdoctor with this Python"
        )
    return "the native path is not built here (kvdoctor was installed without a C compiler): reinstall it where gcc or clang is present"
