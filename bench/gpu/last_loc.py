"""last_loc on a GPU with SGLang 0.5.9's real PagedTokenToKVPoolAllocator (Triton alloc_extend kernel)
and MHATokenToKVPool.set_kv_buffer.

--case oor:   a request with a prefix that is not page aligned (so alloc_extend's part 1 continues
              the prefix's last page at last_loc + 1) gets last_loc = size + page_size (one past the
              KV buffer); its out_cache_loc is then written into the real KV pool. Run it under
              `compute-sanitizer --tool memcheck`, without and with `--fix clamp-last-loc`.
              `--harness-clamp` instead corrects last_loc in this script, page-aware: an out-of-range
              value goes to the slot of the last page whose offset matches the prefix.
--case stale: the request's last page is moved after get_last_loc (row rewritten to a new page, the
              old page freed) and before alloc_extend: a stale last_loc (`--fix recompute-last-loc`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["oor", "stale"], required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--fix", action="append", default=[])
    ap.add_argument("--harness-clamp", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang.state import sglang_state

    probe = runtime.activate(a.trace, fixes=a.fix)
    import sglang.srt.mem_cache.common as common059
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    dev, ps, size, heads, dim = "cuda", 16, 4096, 8, 128
    kv = MHATokenToKVPool(
        size=size, page_size=ps, dtype=torch.bfloat16, head_num=heads, head_dim=dim, layer_num=2, device=dev, enable_memory_saver=False
    )
    allocator = PagedTokenToKVPoolAllocator(size, ps, dtype=torch.bfloat16, device=dev, kvcache=kv, need_sort=False)
    req_pool = ReqToTokenPool(size=8, max_context_len=1024, device=dev, enable_memory_saver=False)
    from kvdoctor.demo.workload import Request

    req = Request("r0")
    req_pool.alloc([req])
    idx = req.req_pool_idx
    prefix, extend = 20, 40  # 20 % 16 = 4: part 1 continues the prefix's page with 12 slots
    pre = allocator.alloc(32)  # two pages for the prefix
    req_pool.write((idx, slice(0, prefix)), pre[:prefix].to(torch.int32))
    idx_t = torch.tensor([idx], dtype=torch.int64, device=dev)
    pl = torch.tensor([prefix], dtype=torch.int64, device=dev)
    sl = torch.tensor([prefix + extend], dtype=torch.int64, device=dev)
    last_loc = common059.get_last_loc_torch(req_pool.req_to_token, idx_t, pl)
    result = {
        "case": a.case,
        "fixes": a.fix,
        "harness_clamp": a.harness_clamp,
        "size": size,
        "page_size": ps,
        "kv_rows": kv.k_buffer[0].shape[0],
        "prefix_len": prefix,
        "extend": extend,
        "set_kv_buffer_impl": None,
    }
    if a.case == "oor":
        last_loc = torch.full_like(last_loc, size + ps)  # one past the end (the clamp(0, total_slots) bug)
        if a.harness_clamp:
            rows = size + ps
            ok = (last_loc >= -1) & (last_loc < rows)
            last_loc = torch.where(ok, last_loc, rows - ps + (pl - 1) % ps)
    else:
        old_page = int(pre[prefix - 1]) // ps
        new = allocator.alloc(ps)
        req_pool.write((idx, slice(16, prefix)), new[: prefix - 16].to(torch.int32))
        allocator.free(torch.arange(old_page * ps, old_page * ps + ps, dtype=torch.int64, device=dev))
        result["old_page"] = old_page
        result["new_page"] = int(new[0]) // ps
    result["last_loc_passed"] = int(last_loc[0])
    out = allocator.alloc_extend(pl, pl.cpu(), sl, sl.cpu(), last_loc, extend)
    torch.cuda.synchronize()
    if probe is not None:  # the ledger's findings reach the trace before the KV write is launched
        for ledger in sglang_state(probe).ledgers.values():
            ledger.poll(force=True)
        probe.emitter.flush()
    out_host = out.cpu().tolist()
    result["out_cache_loc_part1"] = out_host[:12]
    result["out_cache_loc_max"] = max(out_host)
    result["out_of_range_slots"] = sum(1 for x in out_host if x >= size + ps or x < 0)
    if a.case == "stale":
        result["part1_pages"] = sorted({x // ps for x in out_host[:12]})
    # write the new tokens' K/V where alloc_extend said, as the attention layer does
    from sglang.jit_kernel.kvcache import can_use_store_cache

    result["set_kv_buffer_impl"] = "jit store_cache" if can_use_store_cache(heads * dim * 2) else "torch index_put fallback"
    print(json.dumps(result), flush=True)
    k = torch.randn(extend, heads, dim, dtype=torch.bfloat16, device=dev)
    for layer_id in range(2):
        kv.set_kv_buffer(types.SimpleNamespace(layer_id=layer_id), out, k, k)
    torch.cuda.synchronize()
    result["completed"] = True
    if probe is not None:
        result["probe"] = {"ledger_on": probe.ledger_on, "failures": probe.failures, "fix_counts": dict(probe.fix_counts)}
    print("RESULT " + json.dumps(result), flush=True)
    runtime.deactivate()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
