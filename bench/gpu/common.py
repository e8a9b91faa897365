"""Shared set-up for the GPU scripts: SGLang 0.5.9 on a machine without sgl-kernel, its HiCache stack, and
/proc sampling."""

from __future__ import annotations

import json
import os
import re
import shutil
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


def hicache_059(
    torch,
    device: str,
    *,
    size: int,
    page_size: int,
    layers: int,
    heads: int,
    head_dim: int,
    req_slots: int,
    max_context: int,
    hicache_ratio: float,
    storage_backend: str | None = None,
    storage_extra_config: str | None = None,
):
    """SGLang 0.5.9's device pools and its real HiRadixCache, which builds the host pool
    (`MHATokenToKVPoolHost`) and the `HiCacheController` as a server's scheduler does (`direct` I/O,
    `layer_first`, write-through). The allocator is the one a server picks for the page size.
    Glue, not SGLang's: a plain namespace stands for ServerArgs (the fields HiRadixCache and the
    controller read; the real one needs a model), the controller's tensor-parallel rank/size lookups
    return 0/1 (one process, SGLang's distributed state not initialised), and the tree's group is a
    one-process gloo group. Returns the parts and `build_s`, the seconds HiRadixCache took."""
    import tempfile
    import types

    import sglang.srt.managers.cache_controller as cc_mod
    import torch.distributed as dist
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    cc_mod.get_tensor_model_parallel_rank = lambda: 0
    cc_mod.get_tensor_model_parallel_world_size = lambda: 1
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='gloo-')}", rank=0, world_size=1)
    server_args = types.SimpleNamespace(
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        disable_hicache_numa_detect=True,
        hicache_ratio=hicache_ratio,
        hicache_size=0,
        hicache_storage_backend=storage_backend,
        extra_metric_labels=None,
        hicache_storage_backend_extra_config=storage_extra_config,
        hicache_storage_prefetch_policy="best_effort",
        hicache_write_policy="write_through",
        served_model_name="tiny",
    )
    kv = MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device=device,
        enable_memory_saver=False,
    )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, dtype=torch.bfloat16, device=device, kvcache=kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype=torch.bfloat16, device=device, kvcache=kv, need_sort=False)
    req_pool = ReqToTokenPool(size=req_slots, max_context_len=max_context, device=device, enable_memory_saver=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        tp_cache_group=dist.group.WORLD,
    )
    t_build = time.monotonic()
    tree = HiRadixCache(params, server_args)
    return types.SimpleNamespace(
        kv=kv,
        allocator=allocator,
        req_pool=req_pool,
        tree=tree,
        host=tree.token_to_kv_pool_host,
        controller=tree.cache_controller,
        build_s=round(time.monotonic() - t_build, 2),
    )


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


def compute_sanitizer() -> str:
    """compute-sanitizer on the PATH or in CUDA's own folder; '' when there is none."""
    for candidate in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return ""


def memcheck_error_counts(text: str) -> list[int]:
    """The error counts of memcheck's ERROR SUMMARY lines in `text`, in order."""
    # not "ERROR SUMMARY: 14 errors were not printed", the part of the count above --print-limit
    return [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text, flags=re.MULTILINE)]
