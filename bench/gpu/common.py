"""Shared set-up for the GPU scripts: SGLang 0.5.9 on a machine without sgl-kernel, and /proc sampling."""

from __future__ import annotations

import json
import os
import threading
import time


def install_direct_transfer(async_host_to_device: bool = False) -> None:
    """Gives `sgl_kernel.kvcacheio.transfer_kv_direct` a torch implementation (index copies per
    layer) before SGLang's memory_pool_host imports it. The import-only sgl_kernel stand-in raises
    for every kernel; HiCache's `direct` I/O backend with the `layer_first` layout calls this one.
    With `async_host_to_device`, host-to-device copies go through pinned memory without blocking
    the host, as sgl-kernel's do (cudaMemcpyAsync on the current stream): a load then stays in
    flight on its stream after the call returns."""
    import sgl_kernel.kvcacheio as kio

    def to_device(t, device):
        if t.device == device:
            return t
        if async_host_to_device and t.device.type == "cpu" and device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        for src, dst in zip(src_layers, dst_layers, strict=False):
            rows = src.index_select(0, to_device(src_indices, src.device))
            dst.index_copy_(0, to_device(dst_indices, dst.device), to_device(rows, dst.device))

    kio.transfer_kv_direct = transfer_kv_direct
    kio.__torch_direct__ = True


def read_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class RssSampler:
    """Samples this process's RSS (anon, shmem, file) every `interval` seconds with a label."""

    def __init__(self, interval: float = 0.25, label=lambda: {}) -> None:
        self.interval = interval
        self.label = label
        self.samples: list[dict] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def sample(self) -> dict:
        s = {"t": round(time.monotonic() - self.t0, 3), **read_status(), **self.label()}
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:
                pass
            self._stop.wait(self.interval)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sample()
        return self.samples


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 when undefined)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=False)) / var


def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
