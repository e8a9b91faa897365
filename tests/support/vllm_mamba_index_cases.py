"""vllm#55600 on vLLM's own V2 model state, in this process, no kernel: vLLM's real
`MambaHybridModelState` (vllm/v1/worker/gpu/model_states/mamba_hybrid.py) built from a real
`VllmConfig` in "align" Mamba prefix caching, attention blocks of 16 tokens and mamba blocks of 64,
on device "cpu", under the probe. Run with a vLLM venv's Python:

    python tests/support/vllm_mamba_index_cases.py MODEL_DIR TRACE

MODEL_DIR: any model directory (only its config is read, for the model's settings).

Not vLLM's: the model handed to the model state is a bare `torch.nn.Module` (`add_request` reads no
model attribute; the model is only kept), and no kernel runs (Triton is not on CPU): the column
vLLM's own `add_request` seeds in `_mamba_state_idx_gpu` is what the next step's
`preprocess_mamba_align_fused_kernel` would read, and the case prints it as vLLM left it.

Two real `NewRequestData`, as the scheduler hands a worker a new request: "resumed-0", a 200-token
prompt resuming over a cached prefix of 128 tokens (two mamba blocks; 13 attention blocks and 4
mamba block ids), and "fresh-1", nothing computed. 0.28-0.31 seed column (128 - 1) // 16 = 7 for
the first, past its 2 computed mamba blocks (and its 4 block ids); 0.32 seeds (128 - 1) // 64 = 1.
Both seed -1 (a fresh state) for the second.
"""

import json
import sys

BLOCK_SIZE = 16
MAMBA_BLOCK_SIZE = 64
PROMPT_TOKENS = 200
CACHED_TOKENS = 128


def main() -> None:
    model, trace = sys.argv[1], sys.argv[2]
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(trace)

    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    config = VllmConfig(
        model_config=ModelConfig(model=model, max_model_len=512, skip_tokenizer_init=True),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE, mamba_block_size=MAMBA_BLOCK_SIZE, mamba_cache_mode="align", enable_prefix_caching=True
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=256, max_num_seqs=4, max_model_len=512, enable_chunked_prefill=True, is_encoder_decoder=False
        ),
    )
    model_state = MambaHybridModelState(config, torch.nn.Module(), None, torch.device("cpu"))
    prompt = [(7 * j) % 500 + 1 for j in range(PROMPT_TOKENS)]
    attention_blocks = -(-PROMPT_TOKENS // BLOCK_SIZE)
    mamba_blocks = -(-PROMPT_TOKENS // MAMBA_BLOCK_SIZE)
    requests = [
        ("resumed-0", CACHED_TOKENS, (list(range(1, attention_blocks + 1)), list(range(100, 100 + mamba_blocks)))),
        ("fresh-1", 0, (list(range(20, 20 + attention_blocks)), list(range(200, 200 + mamba_blocks)))),
    ]
    seeded = {}
    for req_index, (rid, computed, block_ids) in enumerate(requests):
        new_req = NewRequestData(
            req_id=rid,
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            block_ids=block_ids,
            num_computed_tokens=computed,
            lora_request=None,
            prefill_token_ids=prompt,
        )
        model_state.add_request(req_index, new_req)
        seeded[rid] = int(model_state._mamba_state_idx_gpu[req_index])

    out = {
        "version": probe.version_of("vllm"),
        "map": getattr(probe.maps.get("vllm"), "source", None),
        "align": model_state._align_mode,
        "block_size": config.cache_config.block_size,
        "mamba_block_size": config.cache_config.mamba_block_size,
        "seeded": seeded,
        "hooked": bool(getattr(MambaHybridModelState.add_request, "__kvdoctor_role__", None)),
        "hooked_calls": probe.calls,
        "ledger_on": probe.ledger_on,
        "ledgers_off": sorted(probe.ledgers_off),
    }
    runtime.deactivate()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
