"""On the GPU: the host time of one hooked call, SGLang 0.5.9's real `TokenToKVPoolAllocator.alloc(32)`,
the decode step's batched `ReqToTokenPool.write` of those 32 slots (a row each) and the `free`, and a
paged decode step's `get_last_loc` and `alloc_decode` with its last_loc (page 16), without the probe, with it on the Python path (its kernels launched through the
driver from Python, KVDOCTOR_LEDGER_LAUNCH=driver) and with the native fast path (the default).

graph_decode.py's host time per step includes the waits of a full launch queue whenever the GPU is
the slower side, so its per-call difference is not the probe's own cost. Here each call is timed
alone (perf_counter around it), the stream is drained (untimed) every 32 pairs so the queue never
fills, and the three arms alternate in one process, each round on a fresh allocator (the probe
activated and deactivated around its arm). Medians and quartiles in microseconds; RESULT {json}.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import types


def arm(torch, allocator_cls, pool_cls, pairs: int) -> dict[str, list[float]]:
    allocator = allocator_cls(65536, dtype=torch.bfloat16, device="cuda", kvcache=None, need_sort=False)
    pool = pool_cls(64, 4096, "cuda", False)
    rows = torch.arange(32, device="cuda")
    columns = torch.full((32,), 7, device="cuda")
    first = allocator.alloc(32)  # the ledger (if any) is made here, and its kernels compiled
    pool.write((rows, columns), first.to(torch.int32))
    allocator.free(first)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {"alloc": [], "write": [], "free": []}
    clock = time.perf_counter
    for i in range(pairs):
        t0 = clock()
        out = allocator.alloc(32)
        t1 = clock()
        slots = out.to(torch.int32)  # as SGLang's decode does before its write; not timed
        t2 = clock()
        pool.write((rows, columns), slots)
        t3 = clock()
        allocator.free(out)
        t4 = clock()
        times["alloc"].append((t1 - t0) * 1e6)
        times["write"].append((t3 - t2) * 1e6)
        times["free"].append((t4 - t3) * 1e6)
        if i % 32 == 31:
            torch.cuda.synchronize()
    return times


def paged_arm(torch, sglang, pairs: int) -> dict[str, list[float]]:
    """A paged decode step's two hooked calls: `get_last_loc` over 32 requests' rows, then
    `alloc_decode` with that last_loc (its check kernel, then the alloc's). Each request sits inside
    a page (17 of 16 tokens, page 16), so every step takes the same slots again and nothing grows."""
    allocator = sglang.PagedTokenToKVPoolAllocator(65536, 16, dtype=torch.bfloat16, device="cuda", kvcache=None, need_sort=False)
    pool = sglang.ReqToTokenPool(64, 4096, "cuda", False)
    rows = torch.arange(32, device="cuda")
    zeros, lengths = torch.zeros(32, dtype=torch.int64), torch.full((32,), 17, dtype=torch.int64)
    out = allocator.alloc_extend(zeros.cuda(), zeros, lengths.cuda(), lengths, torch.full((32,), -1, device="cuda"), 17 * 32)
    for r in range(32):
        pool.write((r, slice(0, 17)), out[17 * r : 17 * (r + 1)])
    before, after, after_cpu = lengths.cuda(), (lengths + 1).cuda(), lengths + 1
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {"get_last_loc": [], "alloc_decode": []}
    clock = time.perf_counter
    for i in range(pairs):
        t0 = clock()
        last = sglang.get_last_loc_torch(pool.req_to_token, rows, before)
        t1 = clock()
        allocator.alloc_decode(after, after_cpu, last)
        t2 = clock()
        times["get_last_loc"].append((t1 - t0) * 1e6)
        times["alloc_decode"].append((t2 - t1) * 1e6)
        if i % 32 == 31:
            torch.cuda.synchronize()
    return times


def summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4)
    return {"median": round(statistics.median(values), 2), "q1": round(q[0], 2), "q3": round(q[2], 2)}


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvdoctor.probe import native
    from kvdoctor.probe.core import runtime

    sglang = types.SimpleNamespace(ReqToTokenPool=ReqToTokenPool)
    from sglang.srt.mem_cache import common  # the hooked function is looked up on its module each call
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    sglang.PagedTokenToKVPoolAllocator = PagedTokenToKVPoolAllocator
    ops = ("alloc", "write", "free", "get_last_loc", "alloc_decode")
    times: dict[str, dict[str, list[float]]] = {m: {op: [] for op in ops} for m in ("off", "driver", "c")}
    launches = {"driver": 0, "c": 0}
    for _ in range(rounds):
        for mode in ("off", "driver", "c"):
            if mode != "off":
                os.environ["KVDOCTOR_LEDGER_LAUNCH"] = mode
                runtime.activate(None)
            before = native.NATIVE.stats()["device_launches"]
            sglang.get_last_loc_torch = common.get_last_loc_torch  # hooked or not, as this arm's probe left it
            timed = arm(torch, TokenToKVPoolAllocator, ReqToTokenPool, pairs) | paged_arm(torch, sglang, pairs)
            for op, values in timed.items():
                times[mode][op] += values[pairs // 10 :]  # the first tenth is warm-up
            if mode != "off":
                launches[mode] += native.NATIVE.stats()["device_launches"] - before
                runtime.deactivate()
    out = {
        "gpu": torch.cuda.get_device_name(),
        "rounds": rounds,
        "pairs": pairs,
        "host_us": {m: {k: summary(v) for k, v in by_op.items()} for m, by_op in times.items()},
        "c_launches": launches,
    }
    for mode in ("driver", "c"):
        out[f"{mode}_added_us"] = {k: round(out["host_us"][mode][k]["median"] - out["host_us"]["off"][k]["median"], 2) for k in ops}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
