"""NVML, the GPU's own account of which process uses how much device memory.

Initialised once and lazily; a missing library, driver or device means "no GPU data", never an
exception. NVML reports host pids: inside a container with its own pid namespace, GPU memory may
be missing.
"""

from __future__ import annotations

import threading
from typing import Any


class Nvml:
    """NVML, initialised once; every failure turns into "no GPU data", never an exception."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._totals: list[int] = []

    def _init(self) -> None:
        self._tried = True
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            totals = [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
        except Exception:
            return
        if handles:
            self._nvml, self._handles, self._totals = pynvml, handles, totals

    @property
    def available(self) -> bool:
        with self._lock:
            if not self._tried:
                self._init()
            return self._nvml is not None

    def usage_by_pid(self) -> dict[int, tuple[int, int]] | None:
        """pid -> (used bytes over all GPUs, total bytes of the GPUs it uses); None if no NVML."""
        if not self.available:
            return None
        out: dict[int, tuple[int, int]] = {}
        for handle, total in zip(self._handles, self._totals, strict=False):
            procs: list[Any] = []
            for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    procs.extend(getattr(self._nvml, name)(handle))
                except Exception:
                    continue
            seen: set[int] = set()
            for proc in procs:
                pid = int(getattr(proc, "pid", 0))
                if pid in seen:
                    continue
                seen.add(pid)
                used = getattr(proc, "usedGpuMemory", None)
                used_bytes = int(used) if isinstance(used, int) and used >= 0 and used < 1 << 60 else 0
                prev_used, prev_total = out.get(pid, (0, 0))
                out[pid] = (prev_used + used_bytes, prev_total + total)
        return out


NVML = Nvml()
