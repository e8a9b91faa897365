"""vLLM's engine core in this process (no server, no multiprocessing) serving the tiny model with
prefix caching, under the probe, then the exit census. Run with .venv-vllm's Python:

    python tests/support/vllm_engine_cases.py MODEL_DIR TRACE [late]

Chats that share a system prompt (prefix-cache hits), one request aborted mid-decode, one long
prompt; prints what vLLM's own pool says at the end. `late`: the probe comes after the engine has
served, with three requests mid-decode (the attach case), and one request's blocks are lost before
the probe comes and another's after: their manager pops them at the finish and never gives them
back to the pool (`lost` in the result: request -> block ids).
"""

import json
import os
import sys

model, trace = sys.argv[1], sys.argv[2]
late = sys.argv[3:] == ["late"]  # the probe comes while the engine serves (as `kvdoctor attach` puts it in)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from kvdoctor.probe.core import runtime  # noqa: E402

probe = None if late else runtime.activate(trace)

from vllm import LLM, SamplingParams  # noqa: E402

# max_num_seqs and max_num_batched_tokens: a CPU test's batch, and the size of the start-up profile
# run's forward (an engine start here took 26 s at vLLM's defaults, 15 s at these)
llm = LLM(
    model=model,
    skip_tokenizer_init=True,
    max_model_len=512,
    enable_prefix_caching=True,
    enforce_eager=True,
    max_num_seqs=8,
    max_num_batched_tokens=512,
)
system = list(range(100, 164))
prompts = [{"prompt_token_ids": system + [200 + i, 300 + i, 400 + i]} for i in range(6)]
prompts.append({"prompt_token_ids": [(7 * i) % 500 for i in range(400)]})  # a long prompt (the vocabulary is 512)
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
outputs = llm.generate(prompts, params, use_tqdm=False)
out = {"generated": [len(o.outputs[0].token_ids) for o in outputs]}


def lose_blocks_of(engine, victims: set, lost: dict) -> None:
    """Each manager drops the blocks of `victims` at their finish: popped from its table, never
    freed (the shape of a free path that forgets them)."""
    scheduler = engine.engine_core.engine_core.scheduler
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:

        def free(request_id, manager=manager, original=manager.free):
            victim = next((v for v in victims if request_id.startswith(v)), None)  # vLLM suffixes ids
            if victim is None:
                return original(request_id)
            popped = manager.pop_blocks_for_free(request_id)
            lost.setdefault(victim, []).extend(b.block_id for b in popped if not b.is_null)

        manager.free = free


def serve(engine, rid: str, tokens: list) -> None:
    engine.add_request(rid, {"prompt_token_ids": tokens}, params)
    while engine.has_unfinished_requests():
        engine.step()


if late:  # requests mid-decode, the prefix cache full of the chats above: then the probe comes
    lost: dict = {}
    lose_blocks_of(llm.llm_engine, {"lost-before", "lost-after"}, lost)
    serve(llm.llm_engine, "lost-before", [(11 * i + 3) % 500 for i in range(40)])  # a prompt no other shares
    for i in range(3):
        llm.llm_engine.add_request(f"running-{i}", {"prompt_token_ids": system + [50 + i, 60 + i]}, params)
    llm.llm_engine.step()
    llm.llm_engine.step()
    probe = runtime.activate(trace)
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    outputs = llm.generate(prompts[:4], params, use_tqdm=False)  # served again, under the probe
    out["generated"] += [len(o.outputs[0].token_ids) for o in outputs]
    serve(llm.llm_engine, "lost-after", [(13 * i + 5) % 500 for i in range(40)])
    out["lost"] = {rid: sorted(set(ids)) for rid, ids in lost.items()}

from kvdoctor.probe.engines.vllm import roles as vllm_roles  # noqa: E402

engine = llm.llm_engine
engine.add_request("aborted", {"prompt_token_ids": system + [7, 8, 9]}, params)
engine.step()
engine.abort_request(["aborted"])
while engine.has_unfinished_requests():
    engine.step()

vllm_roles.state(probe).exit_census()
out["hooked_calls"] = probe.calls
out["ledger_on"] = probe.ledger_on
out["map"] = getattr(probe.maps.get("vllm"), "source", None)
out["version"] = probe.version_of("vllm")
runtime.deactivate()
print("RESULT " + json.dumps(out))
