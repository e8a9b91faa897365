"""Loaded by every Python process started under `kvdoctor run` (this folder is on PYTHONPATH).

Most of those processes never import an engine (shell helpers, compilers, tokenizer workers), so
nothing of kvdoctor is imported here: a finder of a few lines waits for an engine's top-level
package (`import sglang`, `import vllm`) and only then turns the probe on, before the engine's
first module loads. With attribution asked for, the probe starts at once (it watches the whole
process). Where kvdoctor is installed in the process's own environment, its start-up hook
(kvdoctor-autoprobe.pth, kvdoctor/probe/core/entry.py) has done that already and this leaves it be.
Then this hands over to any sitecustomize the environment already had. Nothing here may fail the
host: every error is swallowed.
"""

import os
import sys
from typing import Any

_here = os.path.dirname(os.path.abspath(__file__))
_OFF = ("", "0", "false", "no", "off")  # KVDOCTOR_ATTRIBUTION: not asked for
_ON = ("1", "true", "yes", "on")  # KVDOCTOR_DISABLE: disabled
ENGINE_PACKAGES = ("sglang", "vllm")  # the engines kvdoctor ships maps for (a test holds them equal)


def _activate() -> None:
    try:
        package_root = os.environ.get("KVDOCTOR_PACKAGE_ROOT")
        if package_root and package_root not in sys.path:
            sys.path.append(package_root)  # appended: never shadows the host's own modules
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


class _EngineWatch:
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


try:
    if "kvdoctor.probe.core.entry" in sys.modules:
        pass  # kvdoctor is installed here: its start-up hook (kvdoctor-autoprobe.pth) watches already
    elif os.environ.get("KVDOCTOR_ATTRIBUTION", "").strip().lower() not in _OFF:
        _activate()
    elif os.environ.get("KVDOCTOR_DISABLE", "").strip().lower() not in _ON:  # 0 does not disable (as settings.py reads it)
        sys.meta_path.insert(0, _EngineWatch)
except Exception:
    pass

try:  # chain to the sitecustomize we shadowed, if there is one
    _saved = list(sys.path)
    _ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = _saved
        if "sitecustomize" not in sys.modules and _ours is not None:
            sys.modules["sitecustomize"] = _ours  # the import system reads it back once we return
except Exception:
    pass
