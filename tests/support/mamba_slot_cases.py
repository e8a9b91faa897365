"""Drives SGLang's own prefill pick over a Mamba pool under the probe, one trace per case, and prints
what SGLang's pool held (`RESULT {json}`).

    python tests/support/mamba_slot_cases.py WAITING_TRACE DROPPED_TRACE [DEVICE_TRACE]

Run in a fresh interpreter with the release under test first on PYTHONPATH. The pool is SGLang's
`HybridReqToTokenPool` (its `MambaPool`, one Mamba2 layer, 4 slots) with a `TokenToKVPoolAllocator`
of 48 tokens, the tree SGLang's `MambaRadixCache`, the requests SGLang's `Req`, and the pick
`Scheduler.get_new_batch_prefill` itself (SGLang's `SchedulePolicy`, `PrefillAdder`, `GrammarManager`)
on a `Scheduler` given the fields its `__init__` sets for this path (a whole scheduler needs a model
worker). The tree holds a 16-token prefix with its Mamba state; a request that extends it asks for
more tokens than the allocator has, so `add_one_req` returns NO_TOKEN after `match_prefix` copied the
state into a fresh slot for it (copy-on-write).

- waiting: two picks refuse the request; it stays in the waiting queue. SGLang's own idle check
  (`_check_mamba_memory`) is then asked about the same state.
- dropped: one pick refuses it, SGLang's `_abort_on_waiting_timeout` drops it from the queue (its
  tokenizer socket is a list here), then two more picks.
- device (optional): the waiting case with the pool's tensors on the `meta` device, which stands for
  a GPU: its slot numbers cannot be read without a sync.
"""

import inspect
import json
import sys
import warnings

warnings.filterwarnings("ignore")

PREFIX = list(range(100, 116))


class TokenizerSocket:
    """Where `send_to_tokenizer.send_output` puts what the scheduler tells the tokenizer (a zmq
    socket in a server)."""

    def __init__(self) -> None:
        self.sent: list = []

    def send_output(self, output, recv_obj=None) -> None:
        self.sent.append(getattr(output, "rid", None))


def build(device: str):
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.server_args import get_global_server_args

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4, state_size=4, conv_kernel=2)
    wanted = inspect.signature(HybridReqToTokenPool.__init__).parameters
    extra = {"mamba_layer_ids": [0]} if "mamba_layer_ids" in wanted else {}
    if "enable_overlap_schedule" in wanted:
        extra["enable_overlap_schedule"] = False
    pool = HybridReqToTokenPool(
        size=4,
        mamba_size=4,
        mamba_spec_state_size=4,
        max_context_len=128,
        device=device,
        enable_memory_saver=False,
        cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
        enable_mamba_extra_buffer=False,
        **extra,
    )
    allocator = TokenToKVPoolAllocator(48, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
    tree = MambaRadixCache(CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=1))
    kv, state = allocator.alloc(len(PREFIX)), pool.mamba_pool.alloc(1)
    try:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        tree.insert(InsertParams(key=RadixKey(PREFIX), value=kv, mamba_value=state))
    except ImportError:
        tree.insert(RadixKey(PREFIX), kv, state)

    server_args = get_global_server_args()
    server_args.skip_tokenizer_init, server_args.pp_max_micro_batch_size = True, 4
    scheduler = Scheduler.__new__(Scheduler)

    class TpGroup:  # one rank
        world_size, first_rank, is_first_rank = 1, 0, True

    scheduler.server_args, scheduler.dp_tp_cpu_group, scheduler.dp_tp_group = server_args, None, TpGroup()
    fields = dict(
        grammar_manager=GrammarManager(scheduler),
        running_batch=ScheduleBatch(reqs=[], req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, tree_cache=tree, device="cpu"),
        waiting_queue=[],
        chunked_req=None,
        last_batch=None,
        try_preemption=False,
        enable_priority_preemption=False,
        pp_size=1,
        enable_hierarchical_cache=False,
        enable_hicache_storage=False,
        policy=SchedulePolicy("fcfs", tree, False, False, False),
        chunked_prefill_size=None,
        enable_dynamic_chunking=False,
        page_size=1,
        tree_cache=tree,
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=pool,
        new_token_ratio=0.5,
        max_prefill_tokens=16384,
        max_prefill_bs=0,
        max_running_requests=4,
        is_mixed_chunk=False,
        priority_scheduling_preemption_threshold=0,
        dllm_config=None,
        enable_lora=False,
        disaggregation_mode=DisaggregationMode.NULL,
        truncation_align_size=None,
        prefill_delayer=None,
        enable_metrics=False,
        send_to_tokenizer=TokenizerSocket(),
    )
    for name, value in fields.items():
        setattr(scheduler, name, value)
    return scheduler


def waiting_request(rid: str):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", PREFIX + [7, 8, 9], SamplingParams(max_new_tokens=4096))  # more than the 48 tokens
    req.sampling_params.normalize(None)
    return req


def slot_of(req):
    idx = req.mamba_pool_idx
    return None if idx is None else (int(idx) if idx.device.type == "cpu" else str(idx.device))


def pick(scheduler, steps: list, what: str) -> None:
    batch = scheduler.get_new_batch_prefill()
    pool = scheduler.req_to_token_pool.mamba_pool
    steps.append(
        {
            "step": what,
            "batch": batch is not None,
            "waiting": [(r.rid, slot_of(r)) for r in scheduler.waiting_queue],
            "free": len(pool.free_slots),
        }
    )


def waiting_case(device: str) -> dict:
    scheduler, steps = build(device), []
    req = waiting_request("req-waiting")
    scheduler.waiting_queue.append(req)
    pick(scheduler, steps, "pick 1")
    pick(scheduler, steps, "pick 2")
    own_check = None
    if device == "cpu":  # SGLang's own idle check (check_memory's Mamba half) over the same state
        own_check = bool(scheduler._check_mamba_memory()[0])
    return {"steps": steps, "slot": slot_of(req), "sglang_check_says_leak": own_check}


def dropped_case() -> dict:
    from sglang.srt.environ import envs

    scheduler, steps = build("cpu"), []
    req = waiting_request("req-dropped")
    scheduler.waiting_queue.append(req)
    pick(scheduler, steps, "pick 1")
    held = slot_of(req)
    req.time_stats.wait_queue_entry_time = 1e-9  # queued long ago
    with envs.SGLANG_REQ_WAITING_TIMEOUT.override(0.001):
        scheduler._abort_on_waiting_timeout()
    steps.append({"step": "waiting timeout", "waiting": [r.rid for r in scheduler.waiting_queue], "told": scheduler.send_to_tokenizer.sent})
    pick(scheduler, steps, "pick 2")
    pick(scheduler, steps, "pick 3")
    pool = scheduler.req_to_token_pool.mamba_pool
    return {"steps": steps, "slot_after_refusal": held, "free_at_end": sorted(int(s) for s in pool.free_slots)}


def main() -> None:
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(sys.argv[1])
    import sglang
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu", page_size=1))
    map_source = getattr(probe.maps.get("sglang"), "source", None)
    result = {"version": sglang.__version__, "map": map_source, "waiting": waiting_case("cpu")}
    runtime.deactivate()

    probe = runtime.activate(sys.argv[2])
    result["dropped"] = dropped_case()
    runtime.deactivate()

    if len(sys.argv) > 3:
        probe = runtime.activate(sys.argv[3])
        result["device"] = {**waiting_case("meta"), "ledgers_off": sorted(probe.ledgers_off), "probe_on": probe.ledger_on}
        runtime.deactivate()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
