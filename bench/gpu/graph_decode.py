"""A small decode step captured as a CUDA graph, fed by SGLang 0.5.9's real allocator, with and
without the probe, under torch.cuda.set_sync_debug_mode("error").

Each step: out_cache_loc = TokenToKVPoolAllocator.alloc(bs) (hooked), copied into the graph's
static input, graph.replay() (two matmuls and MHATokenToKVPool.set_kv_buffer per layer at
out_cache_loc); every `--seq-len` steps the sequences end and their slots are freed (hooked).
`--write-rows`: each step also writes out_cache_loc into a real ReqToTokenPool at each request's
row and position (hooked), as SGLang's decode does after its alloc: two hooked calls a step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--trace", default="")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="")
    # one tiny kernel per step and no probe: what any one launch per step costs the stream
    ap.add_argument("--noop-kernel", action="store_true")
    ap.add_argument("--write-rows", action="store_true", help="the batched req_to_token write after each alloc")
    a = ap.parse_args()
    probe = None
    if a.probe:
        from kvdoctor.probe.core import runtime

        probe = runtime.activate(a.trace or None)
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    dev, heads, dim = "cuda", 8, 128
    size = a.bs * a.seq_len * 4
    kv = MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=dim,
        layer_num=a.layers,
        device=dev,
        enable_memory_saver=False,
    )
    allocator = TokenToKVPoolAllocator(size, dtype=torch.bfloat16, device=dev, kvcache=kv, need_sort=False)
    layers = [types.SimpleNamespace(layer_id=i) for i in range(a.layers)]
    w1 = torch.randn(a.hidden, a.hidden, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(a.hidden, heads * dim, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(a.bs, a.hidden, device=dev, dtype=torch.bfloat16)
    loc = torch.zeros(a.bs, dtype=torch.int64, device=dev)

    def step_body():
        h = x
        for layer in layers:
            h = torch.relu(h @ w1)
            k = (h @ w2).view(a.bs, heads, dim)
            kv.set_kv_buffer(layer, loc, k, k)
        return h

    warm = allocator.alloc(a.bs)  # the ledger is created here, outside the timed loop
    loc.copy_(warm)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step_body()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_body()
    allocator.free(warm)
    torch.cuda.synchronize()

    held = []
    calls0 = probe.calls if probe else 0
    noop = torch.zeros(a.bs, dtype=torch.int64, device=dev)
    requests = ReqToTokenPool(a.bs, a.seq_len + 8, dev, False) if a.write_rows else None
    rows = torch.arange(a.bs, device=dev)
    positions = torch.zeros(a.bs, dtype=torch.int64, device=dev)

    def run(n):
        for _i in range(n):
            out = allocator.alloc(a.bs)
            if a.noop_kernel:
                noop.add_(1)
            if requests is not None:
                requests.write((rows, positions), out.to(torch.int32))
                positions.add_(1)
            loc.copy_(out, non_blocking=True)
            graph.replay()
            held.append(out)
            if len(held) == a.seq_len:
                allocator.free(torch.cat(held))
                held.clear()
                positions.zero_()

    run(a.seq_len * 2)  # warm-up
    torch.cuda.synchronize()
    calls0 = probe.calls if probe else 0
    err = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        run(a.steps)
        end.record()
        t_host = time.perf_counter() - t0
    except Exception as exc:  # a synchronisation inside the loop
        err = f"{type(exc).__name__}: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if held:  # the sequences still running end, as a server's would: a clean run replays clean
        allocator.free(torch.cat(held))
        held.clear()
    result = {
        "probe": a.probe,
        "noop_kernel": a.noop_kernel,
        "write_rows": a.write_rows,
        "bs": a.bs,
        "steps": a.steps,
        "layers": a.layers,
        "hidden": a.hidden,
        "error": err,
    }
    if err is None:
        result["gpu_ms_per_step"] = start.elapsed_time(end) / a.steps
        result["host_ms_per_step"] = t_host * 1000 / a.steps
    if probe is not None:
        from kvdoctor.probe.engines.sglang.state import sglang_state

        result["hooked_calls_per_step"] = (probe.calls - calls0) / a.steps
        result["ledger_on"] = probe.ledger_on
        result["failures"] = probe.failures
        result["off_reason"] = probe.off_reason
        kernels = [led.kernels for led in sglang_state(probe).ledgers.values() if led.kernels is not None]
        result["compiled_launches"] = sum(launcher.fast_launches for k in kernels for launcher in k.launchers())
        result["driver_launches"] = sum(launcher.driver_launches for k in kernels for launcher in k.launchers())
        result["ledger_launch"] = os.environ.get("KVDOCTOR_LEDGER_LAUNCH", "default")
        from kvdoctor.probe import native

        result["c_launches"] = native.NATIVE.stats().get("device_launches", 0) if native.NATIVE is not None else 0
        result["probe_gpu_bytes"] = sum(
            t.numel() * t.element_size()
            for led in sglang_state(probe).ledgers.values()
            for t in (led.state, led.owner, led.alloc_site, led.flags, led.violation_site, led.counters)
        )
    try:  # 0.5.9's JIT kernel module; later releases moved it
        from sglang.jit_kernel.kvcache import can_use_store_cache

        result["set_kv_buffer_impl"] = "jit store_cache" if can_use_store_cache(heads * dim * 2) else "torch index_put fallback"
    except ImportError:
        result["set_kv_buffer_impl"] = "this release's own (sglang.jit_kernel.kvcache not present)"
    result["sglang"] = getattr(sys.modules.get("sglang"), "__version__", "?")
    print("RESULT " + json.dumps(result), flush=True)
    if probe is not None:
        from kvdoctor.probe.core import runtime

        runtime.deactivate()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
