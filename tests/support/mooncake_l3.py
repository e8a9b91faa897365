"""A real Mooncake store on this machine, for SGLang's HiCache L3 `mooncake` backend.

`Master` starts the `mooncake_master` binary the package ships, on free ports, over TCP; clients
find each other by P2P handshake, so no metadata server runs. Its binaries link libibverbs even
over TCP: .ci/setup unpacks Debian's libibverbs1 and libnl into .venv/mooncake-sysroot, and
`mooncake_env` puts them on LD_LIBRARY_PATH. `unavailable_reason` says why the store cannot run
here ("" when it can), so tests skip with that sentence.

Run as a script (SGLang 0.5.9 on the path, `mooncake_env`), it drives SGLang's real HiRadixCache,
HiCacheController, MHATokenToKVPoolHost (allocated by Mooncake's host allocator) and MooncakeStore
against a master, the way the scheduler does with `--enable-hierarchical-cache
--hicache-storage-backend mooncake --hicache-write-policy write_through`: match, L3 prefetch,
load back of host hits, allocation, KV writes, insert (write-through backup, then L3 write), and
check_hicache_events() between batches, over multi-turn chats whose old turns fall out of the
host pool and come back from L3. It prints one `RESULT {json}` line: the run's counts, the
master's own metrics, SGLang's host_value ground truth, and RSS samples.

Glue written here, not SGLang's: a namespace stands for ServerArgs; CUDA streams and events are
no-ops on this CPU; tensor-parallel rank/size are 0/1; and the two `direct` I/O kernels of the
page_first_direct layout (`sgl_kernel.kvcacheio`, an import-only stand-in here) are torch index
copies.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSROOT = os.path.join(REPO, ".venv", "mooncake-sysroot")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mooncake_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the unpacked libibverbs/libnl folders first on LD_LIBRARY_PATH."""
    out = dict(env)
    dirs = sorted(glob.glob(os.path.join(SYSROOT, "usr", "lib", "*-linux-gnu")) + glob.glob(os.path.join(SYSROOT, "lib", "*-linux-gnu")))
    if out.get("LD_LIBRARY_PATH"):
        dirs.append(out["LD_LIBRARY_PATH"])
    if dirs:
        out["LD_LIBRARY_PATH"] = os.pathsep.join(dirs)
    return out


def master_binary() -> str | None:
    """The `mooncake_master` executable inside the installed package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "mooncake_master")
        if os.path.isfile(path):
            return path
    return None


def unavailable_reason(env: dict[str, str]) -> str:
    """Why a Mooncake store cannot run here, in one sentence; "" when it can."""
    binary = master_binary()
    if binary is None:
        return "Mooncake is not installed in .venv (mooncake-transfer-engine-non-cuda; run .ci/setup)"
    env = mooncake_env(env)
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"mooncake.store does not load here ({last}); .ci/setup unpacks libibverbs1 into .venv/mooncake-sysroot"
    run = subprocess.run([binary, "--help"], env=env, capture_output=True, text=True, timeout=60)
    if "rpc_port" not in run.stdout + run.stderr:
        return f"mooncake_master does not start here: {(run.stderr.strip().splitlines() or ['no output'])[-1]}"
    return ""


class Master:
    """One `mooncake_master` on free ports (RPC and metrics), stopped by `stop` (its own pid)."""

    def __init__(self, env: dict[str, str], log_path: str, *, lease_ttl_ms: int = 10_000) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master is not installed")
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--rpc_port={self.rpc_port}",
                f"--metrics_port={self.metrics_port}",
                "--rpc_address=127.0.0.1",
                "--metrics_host=127.0.0.1",
                "--enable_http_metadata_server=false",
                f"--default_kv_lease_ttl={lease_ttl_ms}",
                "--logtostderr=true",
            ],
            env=mooncake_env(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if "master_key_count" in self.metrics_text():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mooncake_master did not serve its metrics within 30 s: {self.log_tail()}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    def metrics(self) -> dict[str, float]:
        """The master's own gauges and counters (`master_key_count`, `master_allocated_bytes`, ...)."""
        out: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            if line.startswith("#") or " " not in line or "{" in line:
                continue
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
        return out

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read()[-2000:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


# ----- the workload (run as a script, in a fresh process) -----


def _cpu_stand_ins() -> None:
    """No-op CUDA streams, events and host registration, and no pinning: what SGLang's HiCache
    reaches for on a GPU, so that its CPU path runs here."""
    import contextlib

    import torch

    class Event:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record(self, *args: Any) -> None:
            pass

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

        def wait(self, *args: Any) -> None:
            pass

    class Stream:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def wait_event(self, event: Any) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class Runtime:
        def cudaHostRegister(self, *args: Any) -> int:
            return 0

        def cudaHostUnregister(self, *args: Any) -> int:
            return 0

    empty = torch.empty

    def unpinned_empty(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return empty(*args, **kwargs)

    torch.cuda.Stream = Stream  # type: ignore[misc,assignment]
    torch.cuda.Event = Event  # type: ignore[misc,assignment]
    torch.cuda.stream = lambda s: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a: Stream()  # type: ignore[assignment]
    torch.cuda.cudart = lambda: Runtime()  # type: ignore[assignment]
    torch.empty = unpinned_empty  # type: ignore[assignment]


def _direct_page_first_io() -> None:
    """Torch index copies for the `direct` I/O of the page_first_direct host layout
    ([2, pages, layers, page_size, heads, dim]) before memory_pool_host imports them."""
    import sgl_kernel.kvcacheio as kio

    def backup(src_ptrs: list[Any], dst_ptrs: list[Any], src_indices: Any, dst_indices: Any, page_size: int) -> None:
        layers = len(src_ptrs) // 2
        pages, offsets = dst_indices // page_size, dst_indices % page_size
        for kind, dst in enumerate(dst_ptrs):
            for layer in range(layers):
                dst[pages, layer, offsets] = src_ptrs[kind * layers + layer][src_indices]

    def load(src_ptrs: list[Any], dst_ptrs: list[Any], src_indices: Any, dst_indices: Any, layer_id: int, page_size: int) -> None:
        pages, offsets = src_indices // page_size, src_indices % page_size
        for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
            dst[dst_indices] = src[pages, layer_id, offsets]

    kio.transfer_kv_all_layer_direct_lf_pf = backup
    kio.transfer_kv_per_layer_direct_pf_lf = load


def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def run_workload(master: str, trace: str, fixes: list[str], batches: int, host_ratio: float, segment_bytes: int) -> dict[str, Any]:
    import random
    import tempfile
    import types

    _cpu_stand_ins()
    _direct_page_first_io()
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang import hicache

    hicache.LONG_LIVED_S = 0.0
    probe = runtime.activate(trace, fixes=fixes)

    import sglang.srt.managers.cache_controller as cc_mod
    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from kvdoctor.demo.workload import Request

    cc_mod.get_tensor_model_parallel_rank = lambda: 0
    cc_mod.get_tensor_model_parallel_world_size = lambda: 1
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='gloo-')}", rank=0, world_size=1)

    ps, pool_tokens, layers_n, heads, head_dim, batch = 16, 16384, 2, 2, 64, 8
    extra = {
        "master_server_address": master,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "device_name": "",
        "local_hostname": "127.0.0.1",
        "global_segment_size": segment_bytes,
        "prefetch_threshold": 32,
    }
    server_args = types.SimpleNamespace(
        hicache_io_backend="direct",
        hicache_mem_layout="page_first",
        disable_hicache_numa_detect=True,
        hicache_ratio=host_ratio,
        hicache_size=0,
        hicache_storage_backend="mooncake",
        extra_metric_labels=None,
        hicache_storage_backend_extra_config=json.dumps(extra),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_write_policy="write_through",
        served_model_name="tiny",
    )
    kv = MHATokenToKVPool(
        size=pool_tokens,
        page_size=ps,
        dtype=torch.bfloat16,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers_n,
        device="cpu",
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(pool_tokens, ps, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False)
    req_pool = ReqToTokenPool(size=batch * 2, max_context_len=8192, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=ps, tp_cache_group=dist.group.WORLD
    )
    tree = HiRadixCache(params, server_args)  # type: ignore[arg-type]
    host = tree.token_to_kv_pool_host
    ctl = tree.cache_controller
    host.kv_buffer.zero_()  # resident from the start: RSS then grows only by what the run keeps
    info = {
        "host_pool": type(host).__name__,
        "host_layout": host.layout,
        "host_slots": int(host.size),
        "host_allocator": type(host.allocator).__name__,
        "storage_backend": type(ctl.storage_backend).__name__,
        "page_bytes": int(host.get_size_per_token() * ps),
    }

    rng = random.Random(0)
    layers = [types.SimpleNamespace(layer_id=i) for i in range(layers_n)]
    conversations, user_tokens, output_tokens, max_turns = 48, 96, 32, 6
    system_prompt = [rng.randrange(1000) for _ in range(64)]
    histories = [list(system_prompt) for _ in range(conversations)]
    turns = [0] * conversations
    stats = {"requests": 0, "l3_prefetches": 0, "l3_loaded_tokens": 0, "host_hit_tokens": 0, "device_hit_tokens": 0}
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    cursor = 0
    st = hicache.state(probe) if probe is not None else None

    def alloc(need: int, n: int) -> Any:
        if allocator.available_size() < need + ps * n:
            tree.evict(EvictParams(num_tokens=need + ps * n))
        out = allocator.alloc(need)
        if out is None:
            raise RuntimeError("device KV pool exhausted")
        return out

    def settle() -> None:
        """Waits until every backup so far reached the store (acknowledged once batch_set_v1
        returned), so that which pages a later turn finds in L3 does not hang on thread timing."""
        deadline = time.monotonic() + 120
        while tree.ongoing_write_through or tree.ongoing_backup:
            if time.monotonic() > deadline:
                raise RuntimeError("HiCache backups still in flight after 120 s")
            tree.check_hicache_events()
            time.sleep(0.002)

    for step in range(batches):
        settle()
        chosen = []
        for _ in range(batch):
            conv = cursor % conversations
            cursor += 1
            if turns[conv] >= max_turns:
                histories[conv] = list(system_prompt)
                turns[conv] = 0
            turns[conv] += 1
            tokens = histories[conv] + [rng.randrange(1000) for _ in range(user_tokens)]
            req = Request(f"conv{conv}-req{stats['requests']}")
            stats["requests"] += 1
            m = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            matched = len(m.device_indices) + m.host_hit_length
            before = len(tree.ongoing_prefetch)
            tree.prefetch_from_storage(req.rid, m.last_host_node, tokens[matched:], m.last_host_node.get_last_hash_value())
            stats["l3_prefetches"] += len(tree.ongoing_prefetch) - before
            chosen.append((conv, req, tokens))
        live = []
        for conv, req, tokens in chosen:
            deadline = time.monotonic() + 30.0  # only a stuck prefetch waits this long
            while not tree.check_prefetch_progress(req.rid) and time.monotonic() < deadline:
                tree.check_hicache_events()  # a revoked prefetch (too few L3 hits) leaves here
                time.sleep(0.001)
            stats["l3_loaded_tokens"] += tree.pop_prefetch_loaded_tokens(req.rid) or 0
            m = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            prefix, last_node = m.device_indices, m.last_device_node
            stats["device_hit_tokens"] += len(prefix)
            if m.host_hit_length > 0:
                loaded, last_node = tree.init_load_back(m.last_host_node, m.host_hit_length)
                if len(loaded):
                    stats["host_hit_tokens"] += len(loaded)
                    prefix = torch.cat([prefix, loaded])
            tree.inc_lock_ref(last_node)
            req_pool.alloc([req])
            if len(prefix):
                req_pool.write((req.req_pool_idx, slice(0, len(prefix))), prefix.to(torch.int32))
            live.append([conv, req, tokens, prefix, last_node, len(prefix)])
        producer = tree.ready_to_load_host_cache()  # attention waits on this load's layers
        if producer >= 0:
            ctl.layer_done_counter.set_consumer(producer)
        prefix_lens = [item[5] for item in live]
        seq_lens = [len(item[2]) for item in live]
        need = sum(s - p for s, p in zip(seq_lens, prefix_lens, strict=True))
        out = alloc(need, len(live))
        off = 0
        for item, p, s in zip(live, prefix_lens, seq_lens, strict=True):
            req_pool.write((item[1].req_pool_idx, slice(p, s)), out[off : off + s - p].to(torch.int32))
            off += s - p
        values = torch.randn(need, heads, head_dim, dtype=torch.bfloat16)
        for layer in layers:
            kv.get_key_buffer(layer.layer_id)
            kv.set_kv_buffer(layer, out, values, values)
        for _ in range(output_tokens // ps):
            pl = [len(item[2]) for item in live]
            out = alloc(ps * len(live), len(live))
            for j, item in enumerate(live):
                req_pool.write((item[1].req_pool_idx, slice(pl[j], pl[j] + ps)), out[j * ps : (j + 1) * ps].to(torch.int32))
                item[2] = item[2] + [rng.randrange(1000) for _ in range(ps)]
            values = torch.randn(out.numel(), heads, head_dim, dtype=torch.bfloat16)
            for layer in layers:
                kv.set_kv_buffer(layer, out, values, values)
        ctl.layer_done_counter.set_consumer(-1)
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
        samples.append({"t": round(time.monotonic() - t0, 3), "batch": step + 1, **_rss(), **(dict(st.counts) if st is not None else {})})

    settle()  # as an idle scheduler would: afterwards the store and the ledger have seen every write

    storages: dict[int, int] = {}
    own = nodes = 0
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        value = getattr(node, "host_value", None)
        if value is None or not hasattr(value, "untyped_storage") or value.numel() == 0:
            continue
        nodes += 1
        own += value.numel() * value.element_size()
        storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    truth = {
        "host_nodes": nodes,
        "host_value_bytes": own,
        "distinct_storages": len(storages),
        "retained_storage_bytes": sum(storages.values()),
    }
    l3 = probe.states.get("l3") if probe is not None else None
    ledger = l3.summary() if l3 is not None and hasattr(l3, "summary") else None
    runtime.deactivate()
    return {"info": info, "stats": stats, "truth": truth, "samples": samples, "ledger": ledger}


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--fix", action="append", default=[])
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--host-ratio", type=float, default=2.0)
    ap.add_argument("--segment-mib", type=int, default=64)
    a = ap.parse_args()
    result = run_workload(a.master, a.trace, a.fix, a.batches, a.host_ratio, a.segment_mib << 20)
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # Mooncake's client threads and SGLang's storage threads end with the process


if __name__ == "__main__":
    sys.exit(main())
