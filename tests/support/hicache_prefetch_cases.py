"""SGLang bug sglang#13483 (fixed by #13501, in 0.5.6): a partly served L3 prefetch frees its tail
host slots twice. Run as `python tests/support/hicache_prefetch_cases.py TRACE_PATH` in a fresh
interpreter, the release under test first on PYTHONPATH, then tests/support, then the repo.

In 0.5.5 .. 0.5.5.post3 `HiCacheController._page_transfer` ends with
`append_host_mem_release(host_indices[completed_tokens:])` and `prefetch_io_aux_func` queues the same
slice again; `drain_storage_control_queues` hands both to `HostKVCache.free` (`torch.cat`, no dedup),
so the host pool's free list holds those slots twice. 0.5.6 dropped the release in `_page_transfer`.

SGLang's own classes run here: HiRadixCache over MHATokenToKVPool / PagedTokenToKVPoolAllocator /
ReqToTokenPool on CPU, its HiCacheController with its prefetch and backup threads, its
MHATokenToKVPoolHost and the `file` backend (HiCacheFile, in a temp dir named by
SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR), driven as the scheduler drives them with
`--enable-hierarchical-cache --hicache-storage-backend file --hicache-write-policy write_through`:
insert (write-through to host, then L3; acks awaited with check_hicache_events), evict and
evict_host (the tree forgets the prefix), match_prefix, prefetch_from_storage, check_prefetch_progress
polled with check_hicache_events between, then the drains. Cases, each on a fresh tree and dir:

- tail_lost (wait_complete): L3 loses the prefix's later pages after batch_exists (prefetch thread)
  counted them and before the IO thread reads them: only the first pages come back, completed_tokens
  < len(host_indices). The read of page GATE waits on a FIFO put in place of its file; the later
  files are deleted while it waits, then its bytes are fed.
- terminated (best_effort): check_prefetch_progress terminates the prefetch while the IO thread waits
  on page 0's FIFO; nothing is served, the whole range is the tail.
- missing_before_query (wait_complete, a control): the later files are gone before the prefetch;
  batch_exists trims host_indices to the hits, the tail is empty, no release is doubled.

Glue, not SGLang's: a namespace stands for ServerArgs; CUDA streams and events are no-ops and nothing
is pinned (mooncake_l3's stand-ins, plus torch.zeros); tensor-parallel rank/size are 0/1 over a
one-rank gloo group; the two `direct` kernels of the page_first_direct layout (`sgl_kernel.kvcacheio`,
an import-only stand-in) are torch index copies (mooncake_l3's); the FIFO gate and file deletions; a
counting wrapper on host_mem_release_queue.put (observation, for `queued_twice`); and a look at the
IO threads' stacks to wait until they are idle.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import types
from collections import Counter
from typing import Any

from mooncake_l3 import _cpu_stand_ins, _direct_page_first_io

PS, PAGES, GATE = 4, 8, 2  # page size, prefix pages, the page whose read waits on a FIFO
IO_THREADS = ("(prefetch_io_aux_func)", "(prefetch_thread_func)")


def _io_idle() -> bool:
    """True when every HiCache prefetch thread waits in its queue's get, between operations."""
    frames = sys._current_frames()
    for t in threading.enumerate():
        if not t.name.endswith(IO_THREADS) or t.ident not in frames:
            continue
        names: set[str] = set()
        f: types.FrameType | None = frames[t.ident]
        while f is not None:
            names.add(f.f_code.co_name)
            f = f.f_back
        if "get" not in names or names & {"_page_transfer", "append_host_mem_release", "_storage_hit_query"}:
            return False
    return True


def _wait(cond: Any, what: str, tree: Any = None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        if tree is not None:
            tree.check_hicache_events()
        time.sleep(0.001)


def _build(policy: str, storage: str) -> Any:
    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = storage  # read by HiCacheFile.__init__
    tokens = 256
    kv = MHATokenToKVPool(
        size=tokens, page_size=PS, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=2, device="cpu", enable_memory_saver=False
    )
    allocator = PagedTokenToKVPoolAllocator(tokens, PS, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    req_pool = ReqToTokenPool(size=4, max_context_len=512, device="cpu", enable_memory_saver=False)
    sa = types.SimpleNamespace(
        hicache_ratio=2.0,
        hicache_size=0,
        hicache_write_policy="write_through",
        hicache_io_backend="direct",
        hicache_mem_layout="page_first",
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy=policy,
        hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": PS}),
        served_model_name="tiny",
    )
    if "params" in inspect.signature(HiRadixCache.__init__).parameters:  # 0.5.6 on
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        params = CacheInitParams(
            disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=PS, tp_cache_group=dist.group.WORLD
        )
        return HiRadixCache(params, sa), kv, allocator  # type: ignore[arg-type]
    old = {k: v for k, v in vars(sa).items() if k.startswith("hicache_") and k != "hicache_storage_backend_extra_config"}
    tree = HiRadixCache(
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        tp_cache_group=dist.group.WORLD,
        page_size=PS,
        enable_metrics=False,
        model_name=sa.served_model_name,
        storage_backend_extra_config=sa.hicache_storage_backend_extra_config,
        **old,
    )
    return tree, kv, allocator


def run_case(case: str, scratch: str) -> dict[str, Any]:
    import torch
    from sglang.srt.mem_cache.radix_cache import RadixKey

    policy = "best_effort" if case == "terminated" else "wait_complete"
    storage = tempfile.mkdtemp(prefix=f"{case}-", dir=scratch)
    tree, kv, allocator = _build(policy, storage)
    cc, host = tree.cache_controller, tree.token_to_kv_pool_host
    tokens = [(7 * i + len(case)) % 1000 for i in range(PAGES * PS)]

    # a request's prefill: device KV, insert (write-through to host), then L3 backup, acks awaited
    idx = allocator.alloc(len(tokens))
    values = torch.randn(len(tokens), 2, 16, dtype=torch.bfloat16)
    for layer in range(2):
        kv.set_kv_buffer(types.SimpleNamespace(layer_id=layer), idx, values, values)
    tree.insert(RadixKey(list(tokens)), idx)
    _wait(lambda: not tree.ongoing_write_through and not tree.ongoing_backup, "write-through and L3 backup", tree)
    hashes = list(tree.match_prefix(RadixKey(list(tokens))).last_device_node.hash_value)
    files = [os.path.join(cc.storage_backend.file_path, cc.storage_backend._get_suffixed_key(h) + ".bin") for h in hashes]
    stored = sum(os.path.exists(p) for p in files)

    # memory pressure: device copy evicted, then the host copy (the node leaves the tree)
    tree.evict(len(tokens))
    tree.evict_host(len(tokens))
    forgotten = tree.match_prefix(RadixKey(list(tokens))).host_hit_length == 0

    gate = GATE if case == "tail_lost" else 0 if case == "terminated" else None
    if case == "missing_before_query":
        for p in files[GATE + 1 :]:
            os.remove(p)
    page_bytes = b""
    if gate is not None:
        with open(files[gate], "rb") as fh:
            page_bytes = fh.read()
        os.remove(files[gate])
        os.mkfifo(files[gate])

    released: list[Any] = []  # every page queued for release, in order (observation only)
    put = cc.host_mem_release_queue.put

    def counting_put(item: Any, *args: Any, **kwargs: Any) -> None:
        released.append(item.clone())
        put(item, *args, **kwargs)

    cc.host_mem_release_queue.put = counting_put  # type: ignore[method-assign]

    rid = f"{case}-req"
    m = tree.match_prefix(RadixKey(list(tokens)))
    matched = len(m.device_indices) + m.host_hit_length
    tree.prefetch_from_storage(rid, m.last_host_node, tokens[matched:], m.last_host_node.get_last_hash_value())
    _, prefetch_tokens, _, op = tree.ongoing_prefetch[rid]
    early_done = None
    if gate is not None:
        fd = -1

        def writer_opened() -> bool:  # the IO thread has opened the FIFO for its read
            nonlocal fd
            try:
                fd = os.open(files[gate], os.O_WRONLY | os.O_NONBLOCK)
                return True
            except OSError:
                return False

        _wait(writer_opened, "the prefetch IO thread to read the gated page")
        if case == "tail_lost":
            for p in files[gate + 1 :]:
                os.remove(p)
        else:
            early_done = tree.check_prefetch_progress(rid)  # best_effort: terminated here
        os.write(fd, page_bytes)
        os.close(fd)
    _wait(lambda: tree.check_prefetch_progress(rid), "check_prefetch_progress", tree)
    for _ in range(3):
        _wait(_io_idle, "the prefetch threads to go idle")
        time.sleep(0.01)
    for _ in range(3):
        tree.check_hicache_events()  # drain_storage_control_queues frees the release queue's pages

    free = host.free_slots
    counts = Counter(int(s) for s in free.tolist())
    dups = sorted(s for s, c in counts.items() if c > 1)
    queued = Counter(int(s) for t in released for s in t.tolist())
    out = {
        "policy": policy,
        "l3_pages_stored": stored,
        "host_copy_forgotten": forgotten,
        "prefetch_tokens": len(prefetch_tokens),
        "op_host_indices": len(op.host_indices),
        "completed_tokens": int(op.completed_tokens),
        "terminated_by_check": early_done,
        "host_hit_after": int(tree.match_prefix(RadixKey(list(tokens))).host_hit_length),
        "host_free_duplicates": int(len(free) - len(torch.unique(free))),
        "host_free_slots": int(len(free)),
        "host_size": int(host.size),
        "queued_twice": sum(1 for c in queued.values() if c > 1),
        "released_tokens": sum(queued.values()),
        "duplicate_slots": dups[:16],
    }
    shutil.rmtree(storage, ignore_errors=True)
    return out


def main() -> None:
    scratch = tempfile.mkdtemp(prefix="prefetch-", dir=os.path.dirname(os.path.abspath(sys.argv[1])))  # beside the trace
    t0 = time.monotonic()
    _cpu_stand_ins()
    _direct_page_first_io()
    import torch

    zeros = torch.zeros  # get_dummy_flat_data_page asks for pinned zeros, which needs CUDA
    torch.zeros = lambda *a, **k: zeros(*a, **{n: v for n, v in k.items() if n != "pin_memory"})  # type: ignore[assignment]
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(sys.argv[1])
    import sglang
    import sglang.srt.managers.cache_controller as cc_mod
    import torch.distributed as dist

    cc_mod.get_tensor_model_parallel_rank = lambda: 0
    cc_mod.get_tensor_model_parallel_world_size = lambda: 1
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='gloo-', dir=scratch)}", rank=0, world_size=1)

    result: dict[str, Any] = {"version": sglang.__version__, "probe": probe is not None, "pages": PAGES, "page_size": PS}
    result["map"] = getattr(probe.maps.get("sglang"), "source", None) if probe is not None else None
    cases = {}
    for case in ("tail_lost", "terminated", "missing_before_query"):
        try:
            cases[case] = run_case(case, scratch)
        except Exception as e:  # a probe wrapper or a stuck thread: say so, run the other cases
            cases[case] = {"error": repr(e)}
    result.update({k: v for k, v in cases["tail_lost"].items() if k != "policy"})
    result["cases"] = cases
    try:
        runtime.deactivate()
    except Exception as e:  # the probe is being changed elsewhere: report, keep the workload's result
        result["probe_error"] = repr(e)
    shutil.rmtree(scratch, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - t0, 2)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # SGLang's prefetch and backup threads end with the process


if __name__ == "__main__":
    main()
