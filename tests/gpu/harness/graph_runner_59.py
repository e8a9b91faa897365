"""Issue #31 on SGLang 0.5.9's own graph runner: `CudaGraphRunner.replay` replays a real CUDA graph
over the real KV pools while SGLang 0.5.9's own `HiCacheController` loads a request's prefix back
from host memory on its load stream.

The same three cases, JSON and verdict keys as graph_runner_23.py (whose harness this imports:
`main`, `run_case`, `judge`, the CPU stand-ins, `load_prefix_back`, `decode_batch`):
  during   the replay starts while the host-to-device load is still copying: the probe names it
           (`graph_replay_during_load`, with the runner and the tree node the load brings back;
           the batch as far as the map's role reads it: see `BATCH` below)
  guarded  the same with `--fix graph-guard`: the stream replay() runs on waits on the load's finish
           event, on the device; torch.cuda.set_sync_debug_mode("error") is on around replay(), and
           the graph then reads the rows the load wrote
  after    the load has finished (synchronised) before the replay: no finding
A first `after` case runs unreported as a warm-up (the first replay in a process can outlast the load).

SGLang 0.5.9's own code here: `CudaGraphRunner.replay(forward_batch, skip_attn_backend_init=False,
pp_proxy_tensors=None)` and all it calls (`replay_prepare`, `recapture_if_needed`, its
`GraphInputBuffers.create` / `populate_from_forward_batch`, which copy the batch into the graph's
static inputs, `DeepEPCudaGraphRunnerAdapter.replay`); `ForwardBatch`; `MHATokenToKVPool`,
`TokenToKVPoolAllocator`, `ReqToTokenPool`; `HiRadixCache`, which builds `MHATokenToKVPoolHost` and
`HiCacheController` (`common.hicache_059`, as tests/gpu/bugs/sglang_19332_hicache.py builds them); the controller's
`write`/`start_writing` (device to host) and `load`/`start_loading` (host to device on its
`load_stream`, per layer through the host pool's `load_to_device_per_layer`).

Stood in, and why:
- The runner is made with `object.__new__(CudaGraphRunner)` and given only the attributes
  `replay()` and `replay_prepare()` read (`make_runner`): its `__init__` needs a `ModelRunner` (a
  loaded model, its distributed groups, an attention backend sized for it) and captures the model.
  Its static buffers are SGLang's own (`GraphInputBuffers.create`); `model_runner` is a namespace
  with the fields replay reads (`server_args.enable_return_hidden_states`, `spec_algorithm`,
  `attn_backend`).
- The graph is graph_runner_23's small computation, captured with `torch.cuda.graph` into the
  runner's own `graphs` / `output_buffers` under the key replay() looks up (the padded batch size,
  1): per layer it gathers the request's prefix rows of the device pool through `req_to_token` from
  the runner's static `req_pool_indices`/`seq_lens`, sums them, and writes the new token's K and V
  at the static `out_cache_loc`. It stands for the model's forward.
- The attention backend is SGLang's `AttentionBackend` base with the abstract methods filled in;
  0.5.9's base raises in `init_forward_metadata_replay_cuda_graph`, so ours does nothing there (the
  graph reads no attention metadata) and says 1 for `get_cuda_graph_seq_len_fill_value`.
- `cuda_graph_runner.enable_num_token_non_padded` returns False, what it returns with an expert-
  parallel world of one: the real one reads SGLang's MoE expert-parallel group, not set up here.
- The load is held in flight by us: 0.5.9 has no delay knob (0.5.23's
  SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES came later), so the host pool's `load_to_device_per_layer`
  is wrapped on the instance to queue a `torch.cuda._sleep(--delay-cycles)` on the current stream,
  the controller's `load_stream` there, before each layer's copies, as 0.5.23's knob does.
- sgl_kernel: the import-only stand-in (`.carry/sgl_kernel`); `transfer_kv_direct` in torch
  (`common.install_direct_transfer`; on a GPU pinned and non-blocking on the load stream, as
  sgl-kernel's cudaMemcpyAsync, so the host does not wait for the load).
- Server arguments for HiCache: the namespace of `common.hicache_059`, with its rank lookups.
- Glue of ours (graph_runner_23's): the backup's ack is dropped instead of `writing_check`, the
  request's row is written with `ReqToTokenPool.write` (row 1) instead of through a scheduler.

The probe hooks `CudaGraphRunner.replay` with the map's role `graph_execute`, which reads the
batch from its host fields (forward mode, size, slot count); 0.5.9's ForwardBatch has no request
ids, and the request's row lives on the device (reading it would be a synchronisation), so on this
layout the finding names the batch and the loaded node, not the request. `BATCH` is what the
verdict asks of the batch.

On the device machine: `bash tests/gpu/run.sh -k graph_runner` (tests/gpu/README.md says what travels).
Here, without a GPU: `python tests/gpu/harness/graph_runner_59.py --cpu` (SGLang 0.5.9 and tests/support on
PYTHONPATH) runs the same path with graph_runner_23's CPU stand-ins for streams and events (put on
torch.cuda too: 0.5.9's controller takes torch.get_device_module(), torch.cuda in a CUDA build), no
sleep, and the transfer copying at once: a check of the plumbing, not a result.
"""

from __future__ import annotations

import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..", "..", "bench", "gpu")]  # common.py: shared with the GPU server suite
import common  # noqa: E402 - found through the path set just above
import graph_runner_23 as harness  # noqa: E402

BATCH = {"forward_mode": "DECODE", "batch_size": 1, "slots": 1}


def set_up(cpu: bool) -> None:
    """sgl-kernel's direct transfer in torch; on CPU, graph_runner_23's stream and event stand-ins
    also as torch.cuda's: 0.5.9's controller takes `torch.get_device_module()`, which is torch.cuda
    in a CUDA build of torch even without a GPU."""
    common.install_direct_transfer(async_host_to_device=not cpu)
    if cpu:
        import torch

        torch.cuda.Event, torch.cuda.Stream, torch.cuda.stream = torch.cpu.Event, torch.cpu.Stream, torch.cpu.stream


def build_world(a, torch) -> types.SimpleNamespace:
    """The real pools, a one-request row, and 0.5.9's HiRadixCache with its controller."""
    dev = "cpu" if a.cpu else "cuda"
    stack = common.hicache_059(
        torch, dev, size=4096, page_size=1, layers=a.layers, heads=2, head_dim=64, req_slots=4, max_context=a.prefix + 8, hicache_ratio=2.0
    )
    return types.SimpleNamespace(
        a=a,
        dev=dev,
        kv=stack.kv,
        allocator=stack.allocator,
        req_pool=stack.req_pool,
        tree=stack.tree,
        host=stack.host,
        controller=stack.controller,
        value=3.0,
    )


def hold_loads(world: types.SimpleNamespace, torch, cycles: int) -> None:
    """0.5.9 has no delay knob: a sleep kernel is queued on the current stream (the controller's
    load stream, inside start_loading) before each layer's copies."""
    if not cycles:
        return
    load_layer = world.host.load_to_device_per_layer

    def after_a_sleep(*args, **kwargs):
        torch.cuda._sleep(cycles)
        return load_layer(*args, **kwargs)

    world.host.load_to_device_per_layer = after_a_sleep


def make_runner(world: types.SimpleNamespace, torch):
    """CudaGraphRunner without its __init__ (which needs a ModelRunner): the attributes replay() and
    replay_prepare() read, SGLang's own static buffers, and our graph under the key replay() looks
    up. Returns (runner, capture)."""
    import sglang.srt.model_executor.cuda_graph_runner as cgr
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.input_buffers import GraphInputBuffers
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class NoModelAttention(AttentionBackend):
        """SGLang's base backend; our graph reads no attention metadata, so preparing it is a no-op."""

        def init_forward_metadata(self, forward_batch) -> None:
            pass

        def init_forward_metadata_replay_cuda_graph(self, *args, **kwargs) -> None:
            pass

        def get_cuda_graph_seq_len_fill_value(self) -> int:
            return 1

    cgr.enable_num_token_non_padded = lambda server_args: False  # an expert-parallel world of one
    dev = world.dev
    hidden, vocab = 64, 8
    attention = NoModelAttention()
    buffers = GraphInputBuffers.create(
        device=torch.device(dev),
        max_bs=1,
        max_num_token=1,
        hidden_size=hidden,
        vocab_size=vocab,
        dtype=torch.bfloat16,
        dp_size=1,
        pp_size=1,
        is_encoder_decoder=False,
        require_mlp_tp_gather=False,
        seq_len_fill_value=attention.get_cuda_graph_seq_len_fill_value(),
        encoder_len_fill_value=0,
        num_tokens_per_bs=1,
        cache_loc_dtype=torch.int64,
        enable_mamba_track=False,
    )
    runner = object.__new__(cgr.CudaGraphRunner)
    fields = dict(
        model_runner=types.SimpleNamespace(
            device=dev,
            server_args=types.SimpleNamespace(enable_return_hidden_states=False),
            spec_algorithm=SpeculativeAlgorithm.NONE,
            attn_backend=attention,
        ),
        device=dev,
        device_module=torch.get_device_module(dev),
        graphs={},
        output_buffers={},
        deepep_adapter=cgr.DeepEPCudaGraphRunnerAdapter(),
        buffers=buffers,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        capture_forward_mode=ForwardMode.DECODE,
        num_tokens_per_bs=1,
        require_mlp_tp_gather=False,
        require_gathered_buffer=False,
        nsa_enable_prefill_cp=False,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
        capture_bs=[1],
        max_bs=1,
        seq_len_fill_value=attention.get_cuda_graph_seq_len_fill_value(),
        is_encoder_decoder=False,
        is_dllm=False,
    )
    for name, value in fields.items():
        setattr(runner, name, value)
    key = 1  # replay(): graph_key = self.bs, the captured size the batch pads to

    forward = harness.model_forward(world, torch, buffers, vocab)

    def capture() -> None:
        harness.capture_graph(torch, dev, forward, runner.graphs, runner.output_buffers, key)

    return runner, capture


LAYOUT = types.SimpleNamespace(
    runner_name="CudaGraphRunner",
    method="replay",
    batch_evidence=BATCH,
    trace_prefix="graph59-",
    delay_help="cycles of the sleep queued on the load stream before each layer's copies",
    set_up=set_up,
    build_world=build_world,
    hold_loads=hold_loads,
    make_runner=make_runner,
)


if __name__ == "__main__":
    sys.exit(harness.main(LAYOUT))
