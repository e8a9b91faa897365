"""Drives SGLang's own decode loop into its retract path under the probe, one trace per case, and
prints what SGLang's pools held (`RESULT {json}`).

    python tests/support/retract_cases.py OVERLAP_TRACE [PLAIN_TRACE]

Run in a fresh interpreter with the release under test first on PYTHONPATH. The pools are SGLang's
`ReqToTokenPool`, a `TokenToKVPoolAllocator` of 30 slots and a `RadixCache`; the requests SGLang's
`Req`; the batch SGLang's `ScheduleBatch` (`init_new`, `prepare_for_extend`, `filter_batch`); the
loop's steps `Scheduler.update_running_batch` (its `check_decode_mem` and `retract_decode`, which
gives the retracted request's row back, and `prepare_for_decode`) and `Scheduler.process_batch_result`,
on a `Scheduler` given the fields its `__init__` sets for these paths (a whole scheduler needs a
model worker), and a real `ModelConfig` read from a tiny Llama config written here. Only the forward
is not SGLang's: `launch` does what `run_batch` does around it (`forward_ct += 1`, the batch's
`output_ids`, the result kept for later with `batch.copy()`), the sampled tokens being counted up.

- overlap: `event_loop_overlap`'s order: forward N+1 is planned (`update_running_batch`, where a
  retract happens when the 30 slots run out) and launched before forward N's result is processed.
- plain (optional): `event_loop_normal`'s order: each result is processed before the next plan.

`build` and `held` serve preempt_cases.py too, whose releases run to 0.5.9 (its RadixCache takes
`CacheInitParams`, its result processing reads the scheduler's load).

Three requests of 8 tokens decode 8 tokens each, and run out of slots: the retracted ones go back
to the waiting queue (left there), the others finish into the tree.
"""

import json
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

SLOTS = 30


class Socket:
    """Where the scheduler sends to the detokenizer and tokenizer (zmq sockets in a server)."""

    def __init__(self) -> None:
        self.sent: list = []

    def send_pyobj(self, obj) -> None:
        self.sent.append(type(obj).__name__)

    def send_output(self, output, recv_obj=None) -> None:
        self.sent.append(type(output).__name__)


def build(overlap: bool, device: str = "cpu"):
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from transformers import LlamaConfig

    model_dir = tempfile.mkdtemp()
    LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(model_dir)
    # on a GPU the batch's request rows are written by SGLang's Triton kernel (the triton backend)
    backend = {} if device == "cpu" else {"attention_backend": "triton"}
    server_args = ServerArgs(model_path=model_dir, device=device, page_size=1, disable_overlap_schedule=not overlap, **backend)
    try:
        from sglang.srt.server_args import set_global_server_args_for_scheduler
    except ImportError:  # before 0.5.3.post2 the batch reads its server args as arguments
        pass
    else:
        set_global_server_args_for_scheduler(server_args)
    pool = ReqToTokenPool(size=4, max_context_len=64, device=device, enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(SLOTS, dtype=torch.float16, device=device, kvcache=None, need_sort=False)
    scheduler = Scheduler.__new__(Scheduler)
    fields = dict(
        server_args=server_args,
        model_config=ModelConfig.from_server_args(server_args),
        enable_overlap=overlap,
        page_size=1,
        tree_cache=radix_cache(pool, allocator),
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        forward_ct=0,
        forward_ct_decode=0,
        num_generated_tokens=0,
        is_generation=True,
        is_mixed_chunk=False,
        decode_mem_cache_buf_multiplier=1,
        new_token_ratio=0.5,
        new_token_ratio_decay=0.01,
        min_new_token_ratio=0.1,
        waiting_queue=[],
        disaggregation_mode=DisaggregationMode.NULL,
        enable_priority_scheduling=False,
        max_queued_requests=None,
        enable_hierarchical_cache=False,
        enable_hicache_storage=False,
        enable_metrics=False,
        enable_metrics_for_all_schedulers=False,
        enable_trace=False,
        return_health_check_ct=0,
        tp_rank=0,
        attn_tp_rank=1,  # no decode-stats log line
        send_to_tokenizer=Socket(),
        send_to_detokenizer=Socket(),
        # from 0.5.9 each streamed output carries the load (get_load)
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        max_total_num_tokens=SLOTS,
        dp_rank=0,
    )
    if not hasattr(Scheduler, "current_scheduler_metrics_enabled"):  # a method up to 0.5.8, a field from 0.5.9
        fields["current_scheduler_metrics_enabled"] = False
    for name, value in fields.items():
        setattr(scheduler, name, value)
    return scheduler


def radix_cache(pool, allocator):
    """SGLang's RadixCache over these pools: its pools as arguments before 0.5.6, then in CacheInitParams."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    try:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    except ImportError:
        return RadixCache(req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=1)
    return RadixCache(CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=1))


def run(overlap: bool) -> dict:
    """The loop to its end; what SGLang did at each retract, and what its pools hold at the end."""
    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    scheduler = build(overlap)
    tree, pool = scheduler.tree_cache, scheduler.req_to_token_pool
    reqs = []
    for n in range(3):
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        req = Req(f"req-{n}", "", list(range(10 + 10 * n, 18 + 10 * n)), params, vocab_size=scheduler.model_config.vocab_size)
        req.sampling_params.normalize(None)
        req.init_next_round_input(tree)
        tree.inc_lock_ref(req.last_node)  # what PrefillAdder does for a request it takes
        reqs.append(req)
    batch = ScheduleBatch.init_new(
        reqs, pool, scheduler.token_to_kv_pool_allocator, tree, scheduler.model_config, overlap, SpeculativeAlgorithm.NONE
    )
    batch.prepare_for_extend()
    in_flight = []  # (batch copy, result) launched, not yet processed

    def launch(launched) -> None:
        scheduler.forward_ct += 1
        tokens = torch.arange(len(launched.reqs), dtype=torch.int64) + 20 + scheduler.forward_ct
        launched.output_ids = tokens
        in_flight.append((launched.copy(), GenerationBatchResult(next_token_ids=tokens)))

    def process() -> None:
        done, result = in_flight.pop(0)
        scheduler.process_batch_result(done, result)

    retracts = []
    launch(batch)
    running = batch
    for _ in range(40):
        if not overlap:
            process()
        running.filter_batch()
        if running.is_empty():
            break
        # each running request's newest slot: the one of the forward in flight, under overlap
        rows = {
            r.rid: (r.req_pool_idx, int(pool.req_to_token[r.req_pool_idx, int(running.seq_lens_cpu[i]) - 1]))
            for i, r in enumerate(running.reqs)
        }
        waiting = len(scheduler.waiting_queue)
        running = scheduler.update_running_batch(running)
        for req in scheduler.waiting_queue[waiting:]:
            row, slot = rows[req.rid]
            retracts.append({"rid": req.rid, "row": row, "forward_ct": scheduler.forward_ct, "newest_slot": slot})
        launch(running)
        if overlap:
            process()
    while in_flight:
        process()
    return {"retracts": retracts, "waiting": [r.rid for r in scheduler.waiting_queue], **held(scheduler)}


def held(scheduler) -> dict:
    """SGLang's own idle check (`check_memory`: size - available - evictable - protected) and the
    slots nothing holds: not on the free list, in no tree node."""
    allocator, tree = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
    in_tree, nodes = set(), [tree.root_node]
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children.values())
        if node is not tree.root_node and node.value is not None:
            in_tree.update(int(s) for s in node.value.tolist())
    free = {int(s) for s in allocator.free_pages.tolist() + allocator.release_pages.tolist()}
    diff = SLOTS - int(allocator.available_size()) - int(tree.evictable_size()) - int(tree.protected_size())
    return {"sglang_check_diff": diff, "held_by_no_one": sorted(set(range(1, SLOTS + 1)) - free - in_tree)}


def main() -> None:
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(sys.argv[1])
    import sglang

    result = {"version": sglang.__version__, "overlap": run(True)}
    result["map"] = getattr(probe.maps.get("sglang"), "source", None)  # chosen once a mapped module was imported
    runtime.deactivate()
    if len(sys.argv) > 2:
        runtime.activate(sys.argv[2])
        result["plain"] = run(False)
        runtime.deactivate()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
