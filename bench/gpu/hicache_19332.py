"""sglang#19332 with SGLang 0.5.9's real HiCache classes on a GPU.

A CUDA device pool (MHATokenToKVPool), the paged allocator, ReqToTokenPool and HiRadixCache (which
builds the pinned MHATokenToKVPoolHost and the HiCacheController, `direct` I/O backend, write-through,
L3 `file` storage) are driven by a multi-turn chat workload the way the scheduler drives them:
match, L3 prefetch (prefetch_from_storage / check_prefetch_progress), load back of host hits,
allocation (alloc_extend), KV writes (set_kv_buffer), insert (write_backup on write-through), and
check_hicache_events() (writing_check, loading_check, storage queues) between batches.

The process's RSS (anon + shmem) is sampled throughout. Run once without and once with
`--fix clone-host-indices`, each in a fresh process.

Glue written here (not SGLang's): a plain namespace stands for ServerArgs; the tensor-parallel
rank/size lookups of cache_controller return 0/1 (one process, no SGLang distributed init), both in
`common.hicache_059`, which builds the pools and the tree; `sgl_kernel.kvcacheio.transfer_kv_direct`
is a torch implementation (common.py).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fix", action="append", default=[])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=32768)
    ap.add_argument("--hicache-ratio", type=float, default=8.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--long-lived-s", type=float, default=None)
    a = ap.parse_args()

    storage_dir = tempfile.mkdtemp(prefix="hicache-l3-")
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = storage_dir

    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang import hicache

    if a.long_lived_s is not None:
        hicache.LONG_LIVED_S = a.long_lived_s
    probe = runtime.activate(a.trace, fixes=a.fix)
    common.install_direct_transfer()

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from kvdoctor.demo.workload import Request

    dev = a.device
    ps = a.page_size
    stack = common.hicache_059(
        torch,
        dev,
        size=a.pool_tokens,
        page_size=ps,
        layers=a.layers,
        heads=a.heads,
        head_dim=a.head_dim,
        req_slots=a.batch * 2,
        max_context=8192,
        hicache_ratio=a.hicache_ratio,
        storage_backend="file",
        storage_extra_config='{"prefetch_threshold": 64}',
    )
    kv, allocator, req_pool, tree = stack.kv, stack.allocator, stack.req_pool, stack.tree
    host = tree.token_to_kv_pool_host
    ctl = tree.cache_controller
    info = {
        "host_pool_class": type(host).__name__,
        "host_size_slots": host.size,
        "host_pinned": bool(host.kv_buffer.is_pinned()),
        "host_kv_bytes": host.kv_buffer.numel() * host.kv_buffer.element_size(),
        "device_pool_class": type(kv).__name__,
        "device": str(kv.k_buffer[0].device),
        "storage_backend": type(ctl.storage_backend).__name__,
        "io_backend": ctl.io_backend,
        "write_policy": ctl.write_policy,
        "fixes": a.fix,
        "page_size": ps,
        "pool_tokens": a.pool_tokens,
        "build_s": stack.build_s,
        "storage_dir": storage_dir,
    }
    # Touch every page of the host pool (and of a CPU device pool) once, so that RSS does not grow
    # merely because the pool's pages are first written as it fills. cudaHostRegister has already
    # made the pinned pool resident on a GPU machine; this is a no-op there in effect.
    host.kv_buffer.zero_()
    if dev == "cpu":
        for t in list(kv.k_buffer) + list(kv.v_buffer):
            t.zero_()
    print("built", info, flush=True)

    st = hicache.state(probe) if probe is not None else None
    sampler = common.RssSampler(0.25, label=lambda: dict(st.counts) if st is not None else {}).start()
    rng = random.Random(0)
    layers = [types.SimpleNamespace(layer_id=i) for i in range(a.layers)]
    system_prompt = [rng.randrange(1000) for _ in range(64)]
    histories = [list(system_prompt) for _ in range(a.conversations)]
    turns = [0] * a.conversations
    a.heads * a.head_dim
    stats = {
        "batches": 0,
        "requests": 0,
        "load_backs": 0,
        "loaded_tokens": 0,
        "prefetches": 0,
        "evictions": 0,
        "device_hit_tokens": 0,
        "host_hit_tokens": 0,
    }
    t_end = time.monotonic() + a.seconds
    conv_cursor = 0

    def alloc(prefix_lens, seq_lens, need):
        if allocator.available_size() < need + ps * len(prefix_lens):
            tree.evict(EvictParams(num_tokens=need + ps * len(prefix_lens)))
            stats["evictions"] += 1
        pl = torch.tensor(prefix_lens, dtype=torch.int64)
        sl = torch.tensor(seq_lens, dtype=torch.int64)
        if dev == "cpu":
            out = allocator.alloc(need)
        else:
            from sglang.srt.mem_cache import common as c059

            last = c059.get_last_loc_torch(req_pool.req_to_token, torch.tensor(idxs, dtype=torch.int64, device=dev), pl.to(dev))
            out = allocator.alloc_extend(pl.to(dev), pl, sl.to(dev), sl, last, need)
        if out is None:
            raise RuntimeError("device KV pool exhausted")
        return out

    while time.monotonic() < t_end:
        tree.check_hicache_events()
        batch = []
        for _ in range(a.batch):
            conv = conv_cursor % a.conversations
            conv_cursor += 1
            if turns[conv] >= a.max_turns:
                histories[conv] = list(system_prompt)
                turns[conv] = 0
            turns[conv] += 1
            tokens = histories[conv] + [rng.randrange(1000) for _ in range(a.user_tokens)]
            req = Request(f"conv{conv}-req{stats['requests']}")
            stats["requests"] += 1
            # _prefetch_kvcache: start an L3 prefetch for what neither device nor host holds
            m = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            if m.last_device_node.backuped:
                matched = len(m.device_indices) + m.host_hit_length
                before = len(tree.ongoing_prefetch)
                tree.prefetch_from_storage(req.rid, m.last_host_node, tokens[matched:], m.last_host_node.get_last_hash_value())
                stats["prefetches"] += len(tree.ongoing_prefetch) - before
            batch.append((conv, req, tokens))
        tree.check_hicache_events()
        live = []
        idxs = []
        for conv, req, tokens in batch:
            deadline = time.monotonic() + 2.0
            while not tree.check_prefetch_progress(req.rid) and time.monotonic() < deadline:
                time.sleep(0.001)
            tree.pop_prefetch_loaded_tokens(req.rid)
            m = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            prefix, last_node = m.device_indices, m.last_device_node
            stats["device_hit_tokens"] += len(prefix)
            if m.host_hit_length > 0:
                loaded, last_node = tree.init_load_back(m.last_host_node, m.host_hit_length)
                if len(loaded):
                    stats["load_backs"] += 1
                    stats["loaded_tokens"] += len(loaded)
                    stats["host_hit_tokens"] += len(loaded)
                    prefix = torch.cat([prefix, loaded])
            tree.inc_lock_ref(last_node)
            req_pool.alloc([req])
            idx = req.req_pool_idx
            if len(prefix):
                req_pool.write((idx, slice(0, len(prefix))), prefix.to(torch.int32))
            live.append([conv, req, tokens, prefix, last_node, len(prefix)])
            idxs.append(idx)
        producer = tree.ready_to_load_host_cache()
        if producer >= 0:
            ctl.layer_done_counter.set_consumer(producer)
        # prefill: one batched alloc_extend for every request's new tokens (prefixes are page aligned)
        prefix_lens = [item[5] for item in live]
        seq_lens = [len(item[2]) for item in live]
        need = sum(s - p for s, p in zip(seq_lens, prefix_lens, strict=False))
        out = alloc(prefix_lens, seq_lens, need)
        off = 0
        for item, p, s in zip(live, prefix_lens, seq_lens, strict=False):
            req_pool.write((item[1].req_pool_idx, slice(p, s)), out[off : off + s - p].to(torch.int32))
            off += s - p
        k = torch.randn(need, a.heads, a.head_dim, dtype=torch.bfloat16, device=dev)
        for layer in layers:
            kv.get_key_buffer(layer.layer_id)  # waits for this layer's host-to-device load, as attention does
            kv.set_kv_buffer(layer, out, k, k)
        # decode: the output tokens, a page at a time
        for _ in range(a.output_tokens // ps):
            pl = [len(item[2]) for item in live]
            sl = [p + ps for p in pl]
            out = alloc(pl, sl, ps * len(live))
            for j, item in enumerate(live):
                req_pool.write((item[1].req_pool_idx, slice(pl[j], sl[j])), out[j * ps : (j + 1) * ps].to(torch.int32))
                item[2] = item[2] + [rng.randrange(1000) for _ in range(ps)]
            k = torch.randn(out.numel(), a.heads, a.head_dim, dtype=torch.bfloat16, device=dev)
            for layer in layers:
                kv.set_kv_buffer(layer, out, k, k)
        ctl.layer_done_counter.set_consumer(-1)
        # cache_finished_req
        for conv, req, tokens, _prefix, last_node, plen in live:
            kv_idx = req_pool.req_to_token[req.req_pool_idx, : len(tokens)].to(torch.int64).clone()
            aligned = len(tokens) // ps * ps
            res = tree.insert(InsertParams(key=RadixKey(tokens[:aligned]), value=kv_idx[:aligned]))
            new_prefix = int(getattr(res, "prefix_len", res))
            if new_prefix > plen:
                allocator.free(kv_idx[plen:new_prefix])
            if aligned < len(tokens):
                allocator.free(kv_idx[aligned:])
            tree.dec_lock_ref(last_node)
            req_pool.free(req)
            histories[conv] = tokens
        stats["batches"] += 1
        if stats["batches"] % 20 == 0:
            s = sampler.samples[-1] if sampler.samples else {}
            print(
                f"batch {stats['batches']} t={s.get('t')} anon={s.get('RssAnon', 0) / 2**20:.1f}MiB backups={s.get('backups')} sets={s.get('storage_sets')} gets={s.get('storage_gets')} host_free={host.available_size()}",
                flush=True,
            )

    # drain what is in flight, as an idle scheduler would
    for _ in range(50):
        tree.check_hicache_events()
        if not tree.ongoing_write_through and not tree.ongoing_backup:
            break
        time.sleep(0.05)
    samples = sampler.stop()

    # Ground truth, independent of the probe: the distinct arrays the tree's host_value tensors keep alive.
    storages, own, nodes = {}, 0, 0
    stack = [tree.root_node]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        hv = getattr(n, "host_value", None)
        if hv is None or not hasattr(hv, "untyped_storage") or hv.numel() == 0:
            continue
        nodes += 1
        own += hv.numel() * hv.element_size()
        storages[hv.untyped_storage().data_ptr()] = hv.untyped_storage().nbytes()
    truth = {
        "host_nodes": nodes,
        "host_value_bytes": own,
        "distinct_storages": len(storages),
        "retained_storage_bytes": sum(storages.values()),
    }

    summary = summarize(samples)
    result = {
        "info": info,
        "stats": stats,
        "ground_truth": truth,
        "summary": summary,
        "counts": dict(st.counts) if st is not None else {},
        "probe": {
            "ledger_on": probe.ledger_on if probe else None,
            "failures": probe.failures if probe else None,
            "off_reason": probe.off_reason if probe else None,
            "calls": probe.calls if probe else None,
            "fix_counts": dict(probe.fix_counts) if probe else None,
            "patched": list(probe.patched) if probe else None,
            "missing": list(probe.missing) if probe else None,
        },
        "samples": samples[:: max(1, len(samples) // 400)],
    }
    if st is not None:
        result["probe_view_scan"] = st.scan_views(probe, force_report=True)
    print("RESULT", {k: result[k] for k in ("stats", "ground_truth", "summary", "counts")}, flush=True)
    common.write_json(a.out, result)
    runtime.deactivate()
    try:
        tree.shutdown()
    except Exception:
        pass
    os._exit(0)


def summarize(samples: list[dict]) -> dict:
    """RSS growth per 1000 backups and per minute over the second half of the run (after warm-up)."""
    half = [s for s in samples[len(samples) // 2 :] if "backups" in s]
    out = {"samples": len(samples)}
    if len(half) < 4:
        return out
    for key in ("RssAnon", "RssShmem", "VmRSS"):
        ys = [s.get(key, 0) / 2**20 for s in half]
        out[f"{key}_MiB_per_1000_backups"] = round(common.slope([s["backups"] for s in half], ys) * 1000, 3)
        out[f"{key}_MiB_per_min"] = round(common.slope([s["t"] for s in half], ys) * 60, 3)
    out["anon_plus_shmem_start_MiB"] = round((samples[0].get("RssAnon", 0) + samples[0].get("RssShmem", 0)) / 2**20, 1)
    out["anon_plus_shmem_end_MiB"] = round((samples[-1].get("RssAnon", 0) + samples[-1].get("RssShmem", 0)) / 2**20, 1)
    out["backups"] = samples[-1].get("backups")
    out["storage_sets"] = samples[-1].get("storage_sets")
    out["seconds"] = samples[-1]["t"]
    return out


if __name__ == "__main__":
    sys.exit(main())
