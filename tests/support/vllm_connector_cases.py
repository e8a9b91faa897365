"""vLLM's engine core in this process (no server, no multiprocessing) with one of the KV connectors of
`kv_connectors.py`, serving the tiny model under the probe, then the exit census. Run with
.venv-vllm's Python:

    python tests/support/vllm_connector_cases.py CASE MODEL_DIR TRACE

CASE: `delayed_free` (the connector frees a few steps late), `never_free` (it never does),
`late_free` (it frees once the probe has called its holds overdue), or `never_receive` (requests
wait for a remote load that never comes, and are aborted). The cases past the deadline
(`KVDOCTOR_CONNECTOR_DEADLINE_S`) keep stepping the engine until the probe's own writer thread has
called every hold overdue: they wait on that state, never on a guess of how long it takes. Prints
what vLLM's own scheduler still holds.
"""

import json
import os
import sys
import time

case, model, trace = sys.argv[1], sys.argv[2], sys.argv[3]
CONNECTORS = {
    "delayed_free": "DelayedFreeConnector",
    "never_free": "NeverFreeConnector",
    "late_free": "LateFreeConnector",
    "never_receive": "NeverReceiveConnector",
}
REQUESTS = 4
WAIT_LIMIT_S = 120.0  # only a broken probe gets near it
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from kvdoctor.probe.core import runtime  # noqa: E402

probe = runtime.activate(trace)

import kv_connectors  # noqa: E402  (the module vLLM loads by kv_connector_module_path)
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from kvdoctor.probe.engines.vllm import connector as connector_ledger  # noqa: E402
from kvdoctor.probe.engines.vllm import roles as vllm_roles  # noqa: E402

llm = LLM(
    model=model,
    skip_tokenizer_init=True,
    max_model_len=512,
    enable_prefix_caching=True,
    enforce_eager=True,
    max_num_seqs=8,  # a CPU test's batch; also the size of the start-up profile run (vllm_engine_cases.py)
    max_num_batched_tokens=512,
    num_gpu_blocks_override=40,
    kv_transfer_config=KVTransferConfig(kv_connector=CONNECTORS[case], kv_connector_module_path="kv_connectors", kv_role="kv_both"),
)
engine = llm.llm_engine
scheduler = engine.engine_core.engine_core.scheduler
block_size = scheduler.cache_config.block_size
prompts = [{"prompt_token_ids": [(i * 37 + j * 11) % 500 + 1 for j in range(3 * block_size - 4)]} for i in range(REQUESTS)]
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
out: dict = {"case": case, "connector": type(scheduler.connector).__name__, "block_size": block_size}


def step_until(condition, what: str) -> int:
    """Steps the engine until `condition()` holds; returns the steps taken."""
    steps = 0
    give_up = time.monotonic() + WAIT_LIMIT_S
    while not condition():
        if time.monotonic() > give_up:
            raise SystemExit(f"gave up waiting for {what} after {steps} engine steps")
        engine.step()
        steps += 1
        time.sleep(0.02)  # the writer thread's round is 0.5 s: no need to spin
    return steps


if case == "never_receive":
    ids = [f"remote-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    for _ in range(5):
        engine.step()
    out["waiting_statuses"] = sorted({r.status.name for r in scheduler.requests.values()})
    engine.abort_request(ids)
else:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    out["generated"] = [len(o.outputs[0].token_ids) for o in outputs]

steps = 0
while scheduler.requests and steps < 30:  # a correct connector reports within a few steps
    engine.step()
    steps += 1
out["idle_steps"] = steps

holds = connector_ledger.holds(probe)
if case != "delayed_free":
    out["steps_to_overdue"] = step_until(lambda: holds.stats["connector_overdue"] >= REQUESTS, "the holds to be called overdue")
if case == "late_free":
    kv_connectors.LateFreeConnector.release = True
    out["steps_to_release"] = step_until(lambda: not scheduler.requests, "the connector to report every request sent")

manager = scheduler.kv_cache_manager
out["held"] = {rid: sorted(b for group in manager.get_block_ids(rid) for b in group) for rid in scheduler.requests}
out["statuses"] = {rid: r.status.name for rid, r in scheduler.requests.items()}
out["free_blocks"] = manager.block_pool.get_num_free_blocks()
out["num_blocks"] = manager.block_pool.num_gpu_blocks
vllm_roles.state(probe).exit_census()
out["hooked_calls"] = probe.calls
out["ledger_on"] = probe.ledger_on
out["ledgers_off"] = sorted(probe.ledgers_off)
out["deadline_s"] = holds.deadline_s
out["connector_stats"] = dict(holds.stats)
runtime.deactivate()
print("RESULT " + json.dumps(out))
