"""vllm#42571 on vLLM's own scheduler, in this process, no model and no worker: a hybrid KV cache
(a full-attention group and a sliding-window group of 32 tokens, one `BlockPool` of 32 blocks)
behind vLLM's real `Scheduler` with the real `SimpleCPUOffloadConnector` in its eager mode and a
CPU pool of 4 blocks, under the probe. Run with a vLLM venv's Python:

    python tests/support/vllm_hybrid_cases.py MODEL_DIR TRACE

MODEL_DIR: any model directory (only its config is read, for the model's settings).

One request (a 300-token prompt in 64-token chunks, then 6 tokens) runs to its end. The store scan
lags behind the window (4 CPU blocks a step), so a block the window freed, and the request took
again, is listed at both of its positions in one store; the connector touches it twice and its
store completion frees it twice (vLLM's own `_prepare_eager_store_specs` and `_process_store_event`).
The worker's side is what vLLM's own scheduler tests feed back: each step's sampled token, and each
store reported done in the step it was issued. The request finishes in the step its last store
completes, so that free brings the block's count to 0: 0.22's `free_blocks` queues it once per
listing, 0.28's once. Prints the store lists vLLM built and its free queue's count at the end.
"""

import json
import sys

BLOCK_SIZE = 16
NUM_BLOCKS = 32
PROMPT_TOKENS = 300
MAX_TOKENS = 6


def main() -> None:
    model, trace = sys.argv[1], sys.argv[2]
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(trace)

    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
    from vllm.v1.structured_output import StructuredOutputManager

    from kvdoctor.probe.engines.vllm import roles as vllm_roles

    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=32)
    config = VllmConfig(
        model_config=ModelConfig(model=model, max_model_len=512, skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=4, max_model_len=512, enable_chunked_prefill=True, is_encoder_decoder=False
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 4 * full.page_size_bytes},  # 4 CPU blocks
        ),
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=full.page_size_bytes * NUM_BLOCKS, shared_by=["full", "window"])],
        kv_cache_groups=[KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["window"], window)],
    )
    scheduler = Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=BLOCK_SIZE)
    init_none_hash(sha256)
    prompt = [(7 * j) % 500 + 1 for j in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    scheduler.add_request(Request("hybrid-0", prompt, params, None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256)))

    stores: list[list[int]] = []
    for _ in range(100):
        step = scheduler.schedule()
        meta = step.kv_connector_metadata
        done = {}
        if meta is not None and meta.store_event >= 0:
            stores.append(list(meta.store_gpu_blocks))
            done[meta.store_event] = 1
        ids = list(step.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            request = scheduler.requests[rid]
            prefilled = request.num_computed_tokens + step.num_scheduled_tokens[rid] >= request.num_prompt_tokens
            sampled.append([5] if prefilled else [])
        worker = KVConnectorOutput(kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=done))
        output = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled, kv_connector_output=worker
        )
        scheduler.update_from_output(step, output)
        if not scheduler.requests:
            break

    pool = scheduler.kv_cache_manager.block_pool
    vllm_roles.state(probe).exit_census()
    out = {
        "version": probe.version_of("vllm"),
        "map": getattr(probe.maps.get("vllm"), "source", None),
        "connector": type(scheduler.connector).__name__,
        "finished": not scheduler.requests,
        "stores_listing_a_block_twice": [s for s in stores if len(s) != len(set(s))],
        "free_queue_count": pool.free_block_queue.num_free_blocks,
        "usable_blocks": NUM_BLOCKS - 1,  # the null block is never free
        "hooked_calls": probe.calls,
        "ledger_on": probe.ledger_on,
    }
    runtime.deactivate()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
