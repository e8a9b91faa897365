"""Starting the host-memory attribution once per probe, with the engine KVDOCTOR_ATTRIBUTION asks
for: memray or tracemalloc (`attribution_memray.py` chooses, `attribution.py` is tracemalloc's
windows). The probe's activation calls `start_if_enabled`; so does `kvdoctor attach`."""

from __future__ import annotations

import os
import threading
from typing import Any

from kvdoctor.probe.readings.attribution import ENV_ATTRIBUTION, Attribution, _status

_STARTED: dict[int, Attribution] = {}
_LOCK = threading.Lock()


def start_if_enabled(probe: Any, *, force: bool = False) -> bool:
    """Starts attribution for `probe` when KVDOCTOR_ATTRIBUTION=1 (or `force`). Idempotent; never raises.

    The probe's activation calls this once; it also starts the memory-class readings
    (kvdoctor/probe/readings/memory_classes.py), which are on unless KVDOCTOR_MEMORY_CLASSES=0."""
    try:
        from kvdoctor.probe.readings import memory_classes

        memory_classes.start_if_enabled(probe)
    except Exception:
        pass
    try:
        # KVDOCTOR_ATTRIBUTION=memray|auto|tracemalloc (1: tracemalloc); the engines: attribution_memray.py
        from kvdoctor.probe.readings import attribution_memray

        engine = attribution_memray.engine_asked(os.environ.get(ENV_ATTRIBUTION, ""), force=force)
        if engine is None:
            return False
        with _LOCK:
            if id(probe) in _STARTED:
                return True
            worker = attribution_memray.worker_for(probe, engine)
            _STARTED[id(probe)] = worker
        worker.start()
        return True
    except Exception as exc:
        _status(probe, "off", f"{type(exc).__name__}: {exc}")
        return False
