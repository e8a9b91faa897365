"""Drives SGLang's priority preemption onto a request that finished in the last forward result,
under the probe, and prints what SGLang's pools held (`RESULT {json}`).

    python tests/support/preempt_cases.py TRACE

Run in a fresh interpreter with the release under test first on PYTHONPATH. The scheduler, pools
and tiny model config are retract_cases.py's `build` (plain loop: each result is processed before
the next plan); the requests SGLang's `Req`, the batch SGLang's `ScheduleBatch`, the steps
`Scheduler.process_batch_result` and `Scheduler.update_running_batch`, and the preemption SGLang's
`PrefillAdder.preempt_to_schedule`, on an adder built as `get_new_batch_prefill` builds it. Only
the forward is not SGLang's (retract_cases.py says what stands in for it).

Two low-priority requests decode; req-low-0 finishes in the second forward's result, which gives
its row and slots back (into the radix tree). Before the next `update_running_batch` filters it
out of the running batch, a high-priority request comes and the adder preempts the running
requests for it (sglang#17797): up to 0.5.5 `release_req` gives the finished request's slots back
a second time and evicts the tree that holds them; 0.5.9 skips finished requests (PR#18694).
"""

import json
import sys
import time
import warnings

from retract_cases import SLOTS, build, held

warnings.filterwarnings("ignore")


def make_req(rid: str, prompt: list, max_new_tokens: int, priority: int, vocab_size: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    req = Req(rid, "", prompt, params, vocab_size=vocab_size, priority=priority)
    req.sampling_params.normalize(None)
    req.time_stats.wait_queue_entry_time = time.perf_counter()
    return req


def run() -> dict:
    import torch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    scheduler = build(False)
    tree, allocator = scheduler.tree_cache, scheduler.token_to_kv_pool_allocator
    vocab = scheduler.model_config.vocab_size
    reqs = [make_req("req-low-0", list(range(10, 18)), 2, 0, vocab), make_req("req-low-1", list(range(20, 36)), 8, 0, vocab)]
    for req in reqs:
        req.init_next_round_input(tree)
        tree.inc_lock_ref(req.last_node)  # what PrefillAdder does for a request it takes
    running = ScheduleBatch.init_new(
        reqs, scheduler.req_to_token_pool, allocator, tree, scheduler.model_config, False, SpeculativeAlgorithm.NONE
    )
    running.prepare_for_extend()
    scheduler.running_batch = running  # what get_load counts, from 0.5.9

    def forward(batch) -> None:
        scheduler.forward_ct += 1
        tokens = torch.arange(len(batch.reqs), dtype=torch.int64) + 40 + scheduler.forward_ct
        batch.output_ids = tokens
        scheduler.process_batch_result(batch.copy(), GenerationBatchResult(next_token_ids=tokens))

    forward(running)  # the prefill: one token each
    running.filter_batch()
    running = scheduler.update_running_batch(running)
    table = scheduler.req_to_token_pool.req_to_token
    rows = {r.rid: r.req_pool_idx for r in running.reqs}
    slots = {r.rid: table[r.req_pool_idx, : int(running.seq_lens_cpu[i])].tolist() for i, r in enumerate(running.reqs)}
    forward(running)  # req-low-0's second token: it finishes and gives its row back
    finished = [r.rid for r in running.reqs if r.finished()]

    # a high-priority request comes before update_running_batch filters the finished one out
    urgent = make_req("req-high", list(range(50, 54)), 8, 100, vocab)
    urgent.init_next_round_input(tree)
    adder = PrefillAdder(1, tree, allocator, running, scheduler.new_token_ratio, 64, None, 0, priority_scheduling_preemption_threshold=10)
    preempted = adder.preempt_to_schedule(urgent, scheduler.server_args)
    free = allocator.free_pages.tolist() + allocator.release_pages.tolist()
    return {
        "finished": finished,
        "rows": rows,
        "slots": slots,
        "preempted": preempted,
        "preempt_list": sorted(r.rid for r in adder.preempt_list),
        "free_list_twice": sorted({int(s) for s in free if free.count(s) > 1}),
        "free_list_len": len(free),
        "slots_total": SLOTS,
        **held(scheduler),
    }


def main() -> None:
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(sys.argv[1])
    import sglang

    result = {"version": sglang.__version__, "case": run()}
    result["map"] = getattr(probe.maps.get("sglang"), "source", None)
    runtime.deactivate()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
