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


class _EngineWatch:
    """Turns the probe on when an engine's top-level package is first looked up, then steps aside."""

    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> None:
        if path is None and name in ENGINE_PACKAGES:
            try:
                sys.meta_path.remove(cls)
            except ValueError:
                pass
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
