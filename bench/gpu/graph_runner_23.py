"""Issue #31 on SGLang 0.5.23's own graph runner: `DecodeCudaGraphRunner.execute` replays a real CUDA
graph over the real KV pools while SGLang's own HiCache controller loads a request's prefix back from
host memory.

Cases (`--case all` runs the three in one process, each with its own probe, trace, pools, controller
and graph, and writes one JSON with the verdict):
  during   the replay starts while the host-to-device load is still copying: the probe names it
           (`graph_replay_during_load`, with the runner, the batch's forward mode, request id and slot
           count, the stream it replays on and the tree node the load brings back)
  guarded  the same with `--fix graph-guard`: before execute() goes on, the stream it replays on waits
           on the load's finish event, on the device; torch.cuda.set_sync_debug_mode("error") is on
           around execute(), so a host synchronisation anywhere in it raises. The graph then reads the
           rows the load wrote (its output is compared with the host's copy, after a synchronise)
  after    the load has finished (synchronised) before the replay: no finding

SGLang's own code here: `DecodeCudaGraphRunner.execute` and all it calls (`load_batch`, the runner's
`DecodeInputBuffers` and their registry's `fill_from`, which copies the batch into the graph's static
inputs, `FullCudaGraphBackend.replay`); `ForwardBatch`; `MHATokenToKVPool`, `TokenToKVPoolAllocator`,
`ReqToTokenPool`; the host pool and `HybridCacheController` as `build_kv_only_stack` builds them for a
UnifiedRadixCache with HiCache (what 0.5.19+ servers run), its `write`/`start_writing` (device to host)
and `load`/`start_loading` (host to device on the controller's own stream, `L2TransferEngine`); and
SGLang's own test delay `SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES` (a `torch.cuda._sleep` on the load
stream before each layer), which keeps the load in flight long enough to replay during it.

Stood in, and why:
- The runner is made with `object.__new__(DecodeCudaGraphRunner)` and given only the attributes
  `execute()` reads (`make_runner`): its `__init__` needs a `ModelRunner`, i.e. a loaded model with
  its distributed groups, an attention backend sized for it and sgl-kernel's compiled ops in every
  layer, and sgl-kernel's wheels are built for another torch/CUDA than the machine's. Its static
  buffers are SGLang's own (`DecodeInputBuffers.create`, `build_decode_registry`).
- The graph is a small computation of ours captured with `torch.cuda.graph` into the real
  `FullCudaGraphBackend`'s table, under the key `execute()` computes: per layer it gathers the
  request's prefix rows of the device pool through `req_to_token` (the rows HiCache loads back) from
  the runner's static `req_pool_indices`/`seq_lens`, sums them, and writes the new token's K and V
  at the static `out_cache_loc`. It stands for the model's forward.
- The attention backend is SGLang's `AttentionBackend` base (a subclass adding nothing but the
  abstract methods): its replay metadata preparation is the base's own no-op.
- sgl_kernel: the import-only stand-in (`.carry/sgl_kernel`); `transfer_kv_direct` in torch
  (`common.install_direct_transfer(async_host_to_device=True)`: pinned memory and non-blocking copies
  on the load stream, as sgl-kernel's cudaMemcpyAsync, so the host does not wait for the load).
- Server arguments: a real `ServerArgs` (`model_path="dummy"`, resolved without a model) published
  with `get_context().set_server_args`. Process groups: one-process gloo.
- Glue of ours: the backup's ack is dropped instead of `writing_check`, the request's row is written
  with `ReqToTokenPool.write` (row 1) instead of through a scheduler.

On the device machine: `bash bench/gpu/run_graph_runner_23.sh` (README.md says what travels).
Here, without a GPU: `python bench/gpu/graph_runner_23.py --cpu --out /tmp/g.json` runs the same path
with CPU stand-ins for streams and events (an event is in flight until synchronised; a transfer
copies at once), a check of the plumbing (tests/integration/test_graph_replay.py runs it), not a result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

CASES = {"during": [], "guarded": ["graph-guard"], "after": []}


def main(layout: types.SimpleNamespace | None = None) -> int:
    """Runs the cases on `layout`'s runner and controller (default: SGLang 0.5.23's)."""
    layout = layout or LAYOUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--cpu", action="store_true", help="a dry run of the plumbing with CPU stand-ins")
    ap.add_argument("--traces", default="", help="folder for the cases' traces (default: a temporary one)")
    ap.add_argument("--out", default="")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=64, help="tokens of the request's prefix that HiCache loads back")
    ap.add_argument("--delay-cycles", type=int, default=4_000_000_000, help=layout.delay_help)
    a = ap.parse_args()
    traces = a.traces or tempfile.mkdtemp(prefix=layout.trace_prefix)
    os.makedirs(traces, exist_ok=True)
    if a.cpu:
        install_cpu_stand_ins()
    layout.set_up(a.cpu)
    if not a.cpu:
        # Warm-up, not reported: the first execute() in a process loads CUDA modules and kernels
        # lazily, which can take longer than the load's delay, so the load would be over before
        # the replay it was meant to overlap (seen on an H200: the first case read as "after").
        run_case(a, "after", os.path.join(traces, "warmup.trace.json"), layout)
    results = {}
    for case in CASES if a.case == "all" else [a.case]:  # one process: each case its own probe, pools and graph
        trace = os.path.join(traces, f"{case}.trace.json")
        results[case] = run_case(a, case, trace, layout)
        results[case]["findings"] = findings(trace)
    out = {"cpu_dry_run": a.cpu, "traces": traces, "cases": results}
    if a.case == "all":
        out["verdict"] = judge(results, layout.runner_name, layout.batch_evidence)
        # not a criterion: unguarded, the graph read the rows before the load wrote them (GPU only)
        out["unguarded_read_rows_the_load_had_not_written"] = results["during"]["graph_read_loaded_rows"] is False
    print("RESULT " + json.dumps(out), flush=True)
    if a.out:
        common.write_json(a.out, out)
    return 0 if all(out.get("verdict", {}).values()) else 1


def findings(trace: str) -> list[dict]:
    """The trace's findings, as `kvdoctor replay` reports them."""
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.trace.reader import iter_events

    return [{"kind": f.kind, "count": f.count, "message": f.message, "evidence": f.evidence} for f in analyze(iter_events(trace)).findings]


def judge(results: dict, runner: str, batch: dict) -> dict[str, bool]:
    """Issue #31's three cases: named during the load (by `runner`, with the `batch` evidence and
    the loaded node), guarded on the device without a host synchronisation, silent after the load;
    and nothing else found in any of them."""

    def kinds(case: str) -> dict[str, dict]:
        return {f["kind"]: f for f in results[case]["findings"]}

    named = kinds("during").get("graph_replay_during_load", {})
    evidence = named.get("evidence", {})
    guarded = results["guarded"]
    unexpected = {k for case in CASES for k in kinds(case)} - {"graph_replay_during_load", "fix_applied", "probe_partial"}
    return {
        "during_load_is_named": named.get("count") == 1 and evidence.get("graph_runner") == runner,
        "during_load_names_the_batch_and_the_load": {k: evidence.get(k) for k in batch} == batch and evidence.get("load_node_ids") == [7],
        "guarded_waits_on_the_device": kinds("guarded").get("fix_applied", {}).get("evidence", {}).get("fix") == "graph-guard"
        and guarded["sync_error"] is None
        and guarded["load_done_when_execute_returned"] is False,
        "guarded_reads_the_loaded_rows": guarded["graph_read_loaded_rows"] is True,
        "after_load_is_silent": "graph_replay_during_load" not in kinds("after") and results["after"]["sync_error"] is None,
        "nothing_else_found": not unexpected,
    }


def run_case(a: argparse.Namespace, case: str, trace: str, layout: types.SimpleNamespace) -> dict:
    from kvdoctor.probe.core import runtime

    cycles = 0 if a.cpu or case == "after" else a.delay_cycles
    os.environ["SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES"] = str(cycles)  # 0.5.23's knob; read by nothing before it
    probe = runtime.activate(trace, fixes=CASES[case])
    import torch

    world = layout.build_world(a, torch)
    layout.hold_loads(world, torch, cycles)
    runner, capture = layout.make_runner(world, torch)
    capture()
    load = load_prefix_back(world, torch)
    if case == "after":
        finish_loads(a.cpu, torch)
    in_flight_before_batch = not bool(load.ack.finish_event.query())
    t_batch = time.perf_counter()
    batch = decode_batch(world, torch, load)
    batch_s = time.perf_counter() - t_batch
    in_flight_before_execute = not bool(load.ack.finish_event.query())
    waits_before, sync_error, output = CPU.waits, None, None
    if not a.cpu:
        torch.cuda.set_sync_debug_mode("error")
    try:
        output = getattr(runner, layout.method)(batch)
    except RuntimeError as exc:  # a host synchronisation inside execute()
        sync_error = f"{type(exc).__name__}: {exc}"
    finally:
        if not a.cpu:
            torch.cuda.set_sync_debug_mode("default")
    done_at_return = bool(load.ack.finish_event.query())
    finish_loads(a.cpu, torch)
    kv = world.kv
    expected = float(a.layers * a.prefix * kv.head_num * kv.head_dim * 2 * world.value)
    read = float(output.next_token_logits[0, 0]) if output is not None else None
    world.allocator.free(torch.cat([load.device_indices, batch.out_cache_loc]))  # the request ends
    result = {
        "case": case,
        "device": "cpu (stand-ins)" if a.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sglang": __import__("sglang").__version__,
        "runner": type(runner).__name__,
        "runner_method": layout.method,
        "execute_hooked_as": getattr(getattr(type(runner), layout.method), "__kvdoctor_role__", None),
        "controller": type(world.controller).__name__,
        "controller_load_hooked_as": getattr(type(world.controller).load, "__kvdoctor_role__", None),
        "load_node_ids": load.ack.node_ids,
        "load_done_when_execute_returned": done_at_return,
        "load_in_flight_before_batch": in_flight_before_batch,
        "load_in_flight_before_execute": in_flight_before_execute,
        "decode_batch_host_s": round(batch_s, 4),
        "sync_error": sync_error,
        "graph_output": read,
        "loaded_rows_sum": expected,
        "graph_read_loaded_rows": read == expected if read is not None else None,
        "probe_failures": probe.failures if probe else None,
        "probe_off_reason": probe.off_reason if probe else "no probe",
        "cpu_stream_waits": CPU.waits - waits_before if a.cpu else None,
    }
    runtime.deactivate()
    return result


class CpuStandIns:
    """CUDA streams and events on CPU, for the dry run: an event is in flight from `record` until
    synchronised (so the probe's non-blocking `query()` sees a load in flight), and a stream's
    `wait_event` is counted (graph-guard's device-side wait)."""

    def __init__(self) -> None:
        self.waits = 0
        self.events: list = []

    def finish(self) -> None:
        for event in self.events:
            event.done = True

    @staticmethod
    def give_transfers() -> None:
        """pool_host/mha.py imports transfer_kv_direct from sgl-kernel only on CUDA."""
        import sglang.srt.mem_cache.pool_host.mha as mha

        def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
            for src, dst in zip(src_layers, dst_layers, strict=False):
                dst.index_copy_(0, dst_indices, src.index_select(0, src_indices))

        mha.transfer_kv_direct = transfer_kv_direct


CPU = CpuStandIns()


def install_cpu_stand_ins() -> CpuStandIns:
    import contextlib

    import torch

    class Event:
        def __init__(self, *args, **kwargs) -> None:
            self.done = True

        def record(self, *args) -> None:
            self.done = False
            CPU.events.append(self)

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

        def wait(self, *args) -> None:
            pass

        def elapsed_time(self, other) -> float:
            return 0.0

    class Stream:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def wait_event(self, event) -> None:
            CPU.waits += 1

        def wait_stream(self, stream) -> None:
            pass

        def synchronize(self) -> None:
            pass

    class HostRegister:  # the host pool pins its buffer with cudaHostRegister
        def cudaHostRegister(self, *args) -> int:
            return 0

        def cudaHostUnregister(self, *args) -> int:
            return 0

    torch.cuda.cudart = lambda: HostRegister()
    torch.cpu.Event = Event
    torch.cpu.Stream = Stream
    torch.cpu.stream = lambda s: contextlib.nullcontext()
    torch.cpu.current_stream = lambda *a: Stream()
    torch.cuda.current_stream = lambda *a: Stream()
    return CPU


def finish_loads(cpu: bool, torch) -> None:
    """Wait for every copy in flight (outside the sync-debug window)."""
    if cpu:
        CPU.finish()
    else:
        torch.cuda.synchronize()


def build_world(a: argparse.Namespace, torch) -> types.SimpleNamespace:
    """The real pools, a one-request row, and SGLang's HiCache stack for them."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    dev = "cpu" if a.cpu else "cuda"
    get_context().set_server_args(
        ServerArgs(
            model_path="dummy",  # resolves the arguments without a model (no download)
            device=dev,
            page_size=1,
            enable_hierarchical_cache=True,
            hicache_io_backend="direct",
            hicache_mem_layout="layer_first",
            hicache_write_policy="write_through",
            hicache_ratio=2.0,
        )
    )
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_only_stack
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    if a.cpu:
        CPU.give_transfers()
    if not dist.is_initialized():  # one process, once
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='gloo-')}", rank=0, world_size=1)
    size = 4096
    kv = MHATokenToKVPool(
        size=size, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=a.layers, device=dev, enable_memory_saver=False
    )
    allocator = TokenToKVPoolAllocator(size, dtype=torch.bfloat16, device=dev, kvcache=kv, need_sort=False)
    req_pool = ReqToTokenPool(size=4, max_context_len=a.prefix + 8, device=dev, enable_memory_saver=False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=1, tp_cache_group=dist.group.WORLD
    )
    host_group, controller = build_kv_only_stack(
        params=params,
        kv_pool=kv,
        full_layer_mapping={i: i for i in range(a.layers)},
        load_cache_event=threading.Event(),
        storage_backend=None,
        use_mla=False,
    )
    return types.SimpleNamespace(
        a=a, dev=dev, kv=kv, allocator=allocator, req_pool=req_pool, controller=controller, host=host_group, value=3.0
    )


def load_prefix_back(world: types.SimpleNamespace, torch) -> types.SimpleNamespace:
    """A request's prefix written to the device, backed up to the host, evicted from the device
    (freed and zeroed), then loaded back by the controller: the load is in flight on return."""
    a, kv, allocator, ctl = world.a, world.kv, world.allocator, world.controller
    slots = allocator.alloc(a.prefix)
    for layer in range(a.layers):
        kv.k_buffer[layer][slots] = world.value
        kv.v_buffer[layer][slots] = world.value
    host_indices = ctl.write(slots, node_id=7)
    finish_loads(a.cpu, torch)
    ctl.ack_write_queue.clear()
    allocator.free(slots)
    for layer in range(a.layers):
        kv.k_buffer[layer].zero_()
        kv.v_buffer[layer].zero_()
    finish_loads(a.cpu, torch)
    new_token = allocator.alloc(1)  # the decode step's slot, taken before the load starts
    device_indices = ctl.load(host_indices, node_id=7)
    ctl.start_loading()
    ack = ctl.ack_load_queue[-1]
    row = 1  # row 0 is the padding row graph replays point padded requests at
    dtype = world.req_pool.req_to_token.dtype
    world.req_pool.write((row, slice(0, a.prefix)), device_indices.to(dtype))
    world.req_pool.write((row, slice(a.prefix, a.prefix + 1)), new_token.to(dtype))
    return types.SimpleNamespace(ack=ack, row=row, device_indices=device_indices, new_token=new_token)


def decode_batch(world: types.SimpleNamespace, torch, load: types.SimpleNamespace):
    """One decode step of the request: its new token's slot and its row (a real ForwardBatch)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    a, dev = world.a, world.dev
    seq_len = a.prefix + 1
    named = {"rids": ["req-0"]} if "rids" in ForwardBatch.__dataclass_fields__ else {}  # none before 0.5.14
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=1,
        input_ids=torch.zeros(1, dtype=torch.int64, device=dev),
        req_pool_indices=torch.tensor([load.row], dtype=torch.int64, device=dev),
        seq_lens=torch.tensor([seq_len], dtype=torch.int64, device=dev),
        out_cache_loc=load.new_token,
        seq_lens_sum=seq_len,
        seq_lens_cpu=torch.tensor([seq_len], dtype=torch.int64),
        positions=torch.tensor([seq_len - 1], dtype=torch.int64, device=dev),
        capture_hidden_mode=CaptureHiddenMode.NULL,
        **named,
    )


def make_runner(world: types.SimpleNamespace, torch):
    """DecodeCudaGraphRunner without its __init__ (which needs a ModelRunner): the attributes its
    execute() reads, SGLang's own static buffers, and our graph captured into the real
    FullCudaGraphBackend under the key execute() computes. Returns (runner, capture)."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.cuda_graph_buffer_registry import build_decode_registry
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend
    from sglang.srt.model_executor.runner_utils.buffers import DecodeInputBuffers
    from sglang.srt.model_executor.runner_utils.deepep_adapter import DeepEPCudaGraphRunnerAdapter
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class NoModelAttention(AttentionBackend):
        """SGLang's base backend: its replay metadata preparation is the base's own no-op."""

        def forward_extend(self, *args, **kwargs):
            raise NotImplementedError

        def forward_decode(self, *args, **kwargs):
            raise NotImplementedError

    dev = world.dev
    runner = object.__new__(DecodeCudaGraphRunner)
    hidden, vocab = 64, 8
    model_runner = types.SimpleNamespace(
        device=dev,
        device_timer=None,
        model=types.SimpleNamespace(shared_experts_config=None),
        spec_algorithm=SpeculativeAlgorithm.NONE,
        is_draft_worker=False,
        lora_manager=None,
        hisparse_coordinator=None,
        shared_read_done_event=None,
    )
    buffers = DecodeInputBuffers.create(
        device=torch.device(dev),
        max_bs=1,
        max_num_token=1,
        hidden_size=hidden,
        next_token_logits_buffer=torch.zeros(1, vocab, dtype=torch.float32, device=dev),
        dtype=torch.bfloat16,
        num_dp_ranks=1,
        pp_size=1,
        is_encoder_decoder=False,
        require_mlp_tp_gather=False,
        seq_len_fill_value=1,
        encoder_len_fill_value=0,
        num_tokens_per_req=1,
        cache_loc_dtype=torch.int64,
        enable_mamba_track=False,
    )
    registry = build_decode_registry(
        device=torch.device(dev), max_bs=1, max_num_token=1, seq_len_fill_value=1, cache_loc_dtype=torch.int64, source=buffers
    )
    backend = object.__new__(FullCudaGraphBackend)
    backend._graphs, backend._outputs = {}, {}
    fields = dict(
        model_runner=model_runner,
        device=dev,
        device_module=torch.get_device_module(dev),
        attn_backend=NoModelAttention(),
        enable_pdmux=False,
        in_graph_metadata_prep_done=None,
        dllm_uses_input_embeds=False,
        dllm_input_preparation=None,
        is_dllm=False,
        ragged_verify_mode=False,
        deepep_adapter=DeepEPCudaGraphRunnerAdapter(),
        buffers=buffers,
        buffer_registry=registry,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        capture_forward_mode=ForwardMode.DECODE,
        require_mlp_tp_gather=False,
        require_attn_tp_gather=False,
        capture_bs=[1],
        captured_req_width=1,
        attention_graph_variants=None,
        _early_verify_metadata=None,
        _metadata_glue=None,
        _draft_metadata_glue=False,
        _target_metadata_glue=False,
        _skips_prefilled_inputs=False,
        _prefilled_inputs=None,
        enable_two_batch_overlap=False,
        record_nolora_graph=False,
        seq_len_fill_value=1,
        is_encoder_decoder=False,
        num_dp_ranks=1,
        backend=backend,
    )
    for name, value in fields.items():
        setattr(runner, name, value)
    key = runner._make_graph_key(1)

    forward = model_forward(world, torch, buffers, vocab)

    def capture() -> None:
        capture_graph(torch, dev, forward, backend._graphs, backend._outputs, key)

    return runner, capture


def model_forward(world: types.SimpleNamespace, torch, buffers, vocab: int):
    """Our stand-in for the model, on a runner's static buffers: reads the request's prefix rows
    through req_to_token (what HiCache loads back), sums them into the logits, and writes the new
    token's K/V at out_cache_loc."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    a, kv, dev = world.a, world.kv, world.dev

    def forward():
        rows = world.req_pool.req_to_token[buffers.req_pool_indices[:1]][:, : a.prefix].long()
        mask = (torch.arange(a.prefix, device=dev) < (buffers.seq_lens[:1, None] - 1)).float()
        total = torch.zeros(1, device=dev, dtype=torch.float32)
        for layer in range(a.layers):
            k, v = kv.get_key_buffer(layer), kv.get_value_buffer(layer)
            kr = k[rows.flatten()].float().sum(dim=(1, 2)).view(1, a.prefix)
            vr = v[rows.flatten()].float().sum(dim=(1, 2)).view(1, a.prefix)
            total = total + ((kr + vr) * mask).sum(dim=1)
            new = torch.full((1, kv.head_num, kv.head_dim), float(layer + 1), dtype=k.dtype, device=dev)
            k.index_copy_(0, buffers.out_cache_loc[:1], new)
            v.index_copy_(0, buffers.out_cache_loc[:1], new)
        return LogitsProcessorOutput(next_token_logits=total.view(1, 1).expand(1, vocab).contiguous())

    return forward


def capture_graph(torch, dev: str, forward, graphs: dict, outputs: dict, key) -> None:
    """Captures `forward` as a CUDA graph into the runner's tables under `key` (on CPU: a replay
    that calls it)."""
    if dev == "cpu":
        graphs[key] = types.SimpleNamespace(replay=lambda: outputs.__setitem__(key, forward()))
        outputs[key] = forward()
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    torch.cuda.synchronize()
    graphs[key], outputs[key] = graph, out


def hold_loads_with_sglang_knob(world: types.SimpleNamespace, torch, cycles: int) -> None:
    """0.5.23 delays its own loads: SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES, set in run_case."""


def set_up(cpu: bool) -> None:
    """On a GPU, sgl-kernel's direct transfer in torch (non-blocking host-to-device copies)."""
    if not cpu:
        common.install_direct_transfer(async_host_to_device=True)


LAYOUT = types.SimpleNamespace(
    runner_name="DecodeCudaGraphRunner",
    method="execute",
    batch_evidence={"rids": ["req-0"]},
    trace_prefix="graph23-",
    delay_help="SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES",
    set_up=set_up,
    build_world=build_world,
    hold_loads=hold_loads_with_sglang_knob,
    make_runner=make_runner,
)


if __name__ == "__main__":
    sys.exit(main())
