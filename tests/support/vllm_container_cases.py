"""vLLM's engine core in this process serving the tiny model with prefix caching and
`max_tokens=1` (the workload of vllm#44490), under the probe, with a container walk after every
batch. Run with a vLLM venv's Python:

    python tests/support/vllm_container_cases.py MODEL_DIR TRACE BATCHES

Every batch is 8 prompts that share a 48-token system prompt and differ after it; the KV cache is
64 blocks, so a container that keeps every new block id outgrows the pool within a few batches.
"""

import json
import os
import sys
import time


def main() -> None:
    model, trace, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["KVDOCTOR_CONTAINERS_PERIOD_S"] = "1e9"  # walks only where this script asks for them

    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.readings import containers

    probe = runtime.activate(trace)

    from vllm import LLM, SamplingParams

    from kvdoctor.probe.engines.vllm import roles as vllm_roles

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        max_model_len=256,
        enable_prefix_caching=True,
        enforce_eager=True,
        num_gpu_blocks_override=64,
        block_size=32,
        max_num_seqs=8,  # the batch of 8; also the size of the start-up profile run (vllm_engine_cases.py)
        max_num_batched_tokens=512,
        distributed_executor_backend="uni",
    )
    system = list(range(100, 148))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    walker = containers.sizes_state(probe)
    walk_s: list[float] = []
    for batch in range(batches):
        prompts = [{"prompt_token_ids": system + [(batch * 8 + i) % 400 + 1, 450, 451]} for i in range(8)]
        llm.generate(prompts, params, use_tqdm=False)
        started = time.perf_counter()
        walker.walk(probe)
        walk_s.append(time.perf_counter() - started)

    vllm_roles.state(probe).exit_census()
    out = {
        "hooked_calls": probe.calls,
        "ledger_on": probe.ledger_on,
        "map": getattr(probe.maps.get("vllm"), "source", None),
        "version": probe.version_of("vllm"),
        "roots": sorted(label for label, *_ in walker.roots.values()),
        "walk_us": sorted(round(t * 1e6, 1) for t in walk_s),
    }
    runtime.deactivate()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":  # vLLM spawns its CPU worker: the child imports this file again
    main()
