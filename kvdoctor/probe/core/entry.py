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


class EngineWatch:
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
