"""Loaded by every Python process started under `kvdoctor run` (this folder is on PYTHONPATH).

It turns the probe on, then hands over to any sitecustomize the environment already had.
Nothing here may fail the host: every error is swallowed.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
try:
    _package_root = os.environ.get("KVDOCTOR_PACKAGE_ROOT")
    if _package_root and _package_root not in sys.path:
        sys.path.append(_package_root)  # appended: never shadows the host's own modules
    from kvdoctor.probe import runtime as _kvdoctor_runtime

    _kvdoctor_runtime.activate()
except Exception:
    pass

try:  # chain to the sitecustomize we shadowed, if there is one
    _saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    del sys.modules["sitecustomize"]
    try:
        import sitecustomize  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.path[:] = _saved
except Exception:
    pass
