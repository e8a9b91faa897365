"""Drives SGLang's own prefill-result path over a sliding-window pool under the probe, one trace per
case, and prints what SGLang's pool held (`RESULT {json}`).

    python tests/support/swa_pool_cases.py RECOVERY_TRACE APART_TRACE [DEVICE_TRACE]

Run in a fresh interpreter with the release under test first on PYTHONPATH. Everything is SGLang's:
the pool `SWATokenToKVPoolAllocator` over `SWAKVPool` (64 full and 64 SWA slots, page size 1), the
request pool `ReqToTokenPool`, the tree `UnifiedRadixCache` with its FULL and SWA components (a
4-token window), the requests `Req`, their prefill `ScheduleBatch.prepare_for_extend` (on a host
table, the torch_native backend's row writer), and the calls `process_batch_result_prefill` makes
for a request that goes on decoding and one that finished, in its free group:
`maybe_cache_unfinished_req` and `release_kv_cache`. The model's forward is left out: each request's
sampled token is appended as that method does.

- recovery: two requests with the same 16-token prompt in one prefill batch; req-a decodes on,
  req-b (max_new_tokens=1) finished. req-a's caching frees the SWA side of its out-of-window tokens
  (`free_swa_out_of_window_slots`, deferred in the group), inserts them as an SWA tombstone and locks
  the path; req-b's insert over that tombstone, its full side locked, recovers it with req-b's SWA
  slots (`RecoverSWAWithLockedFull`), re-pointing req-a's full slots. The group's end then runs
  req-a's deferred free (sglang#36081).
- apart: the same, the two prompts differing from their first token: no tombstone is recovered.
- device (optional): the pool's full-to-SWA mapping on the `meta` device, which stands for a GPU;
  a free in a group is asked, and the mapping cannot be read without a sync.
"""

import json
import sys
import warnings
from array import array

warnings.filterwarnings("ignore")

PROMPT = list(range(100, 116))
WINDOW = 4
# The requests of each case, held to the end as the scheduler's running batch holds req-a, which
# decodes on: a request object gone with its row still taken is a row left behind (request_rows_leaked)
RUNNING: list = []


def build():
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from kvdoctor.demo.engine import swa_allocator

    allocator = swa_allocator(64, 1)  # SWAKVPool, 64 full and 64 SWA slots
    pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        disable=False,
        sliding_window_size=WINDOW,
        tree_components=(ComponentType.FULL, ComponentType.SWA),
    )
    return allocator, pool, UnifiedRadixCache(params=params)


def row(req) -> int:
    """The request's row: `req.req_pool_idx` up to 0.5.18, `req.kv.req_pool_idx` from 0.5.19."""
    return req.req_pool_idx if hasattr(req, "req_pool_idx") else req.kv.req_pool_idx


def prefill(allocator, pool, tree, prompts: dict):
    """The requests picked into one prefill batch and given their rows and KV slots, as SGLang's
    `PrefillAdder` and `prepare_for_extend` do; then each request's sampled token appended."""
    import types

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    reqs = []
    for rid, (prompt, max_new) in prompts.items():
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=max_new, temperature=0))
        req.sampling_params.normalize(None)
        req.init_next_round_input(tree)
        req.set_extend_range(len(req.prefix_indices), len(req.full_untruncated_fill_ids))
        reqs.append(req)
    model = types.SimpleNamespace(vocab_size=1000, is_encoder_decoder=False)
    batch = ScheduleBatch.init_new(reqs, pool, allocator, tree, model, False, SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()
    for req in reqs:
        req.output_ids.append(7)
        req.update_finish_state()
    return reqs


def result_step(allocator, tree, reqs) -> None:
    """What `process_batch_result_prefill` does for each request, in its free group."""
    from sglang.srt.mem_cache.common import maybe_cache_unfinished_req, release_kv_cache

    allocator.free_group_begin()
    for req in reqs:
        if req.finished():
            release_kv_cache(req, tree)
        else:
            maybe_cache_unfinished_req(req, tree)
    allocator.free_group_end()


def held(allocator, pool, tree, first) -> dict:
    """What SGLang's pool holds after the step: the SWA free list, the tree nodes' SWA slots that are
    free, and the SWA slots req-a's full slots mapped to before, still allocated and mapped from none."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    swa = allocator.swa_attn_allocator
    free = set(swa.free_pages.tolist()) | set(swa.release_pages.tolist())
    mapped = set(allocator.full_to_swa_index_mapping[:-1].tolist())
    nodes, stack = [], list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        full, slots = node.component_data[ComponentType.FULL].value, node.component_data[ComponentType.SWA].value
        if slots is not None:
            nodes.append({"full": full.tolist(), "swa": slots.tolist(), "swa_free": [s for s in slots.tolist() if s in free]})
    return {
        "swa_free": len(free),
        "nodes": sorted(nodes, key=lambda n: n["full"][0]),
        "first_swa_lost": [s for s in first if s not in free and s not in mapped],
    }


def path_case(prompts: dict) -> dict:
    allocator, pool, tree = build()
    reqs = prefill(allocator, pool, tree, prompts)
    a = reqs[0]
    rows = {req.rid: pool.req_to_token[row(req), : len(PROMPT)].tolist() for req in reqs}
    first = allocator.full_to_swa_index_mapping[rows[a.rid]].tolist()
    result_step(allocator, tree, reqs)
    RUNNING.extend(reqs)
    out = held(allocator, pool, tree, first)
    out["rows"] = rows
    out["swa_of_req_a_before"] = first
    out["finished"] = [req.rid for req in reqs if req.finished()]
    return out


def device_case() -> dict:
    import torch

    allocator, _, _ = build()
    allocator.full_to_swa_index_mapping = allocator.full_to_swa_index_mapping.to("meta")
    allocator.free_group_begin()
    allocator.free_swa(torch.arange(1, 5))
    return {"mapping_device": str(allocator.full_to_swa_index_mapping.device)}


def main() -> None:
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(sys.argv[1])
    import sglang
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    # torch_native: the prefill's row writer is ReqToTokenPool.write on a host table (no Triton kernel)
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu", page_size=1, attention_backend="torch_native"))
    result = {
        "version": sglang.__version__,
        "map": getattr(probe.maps.get("sglang"), "source", None),
        "recovery": path_case({"req-a": (PROMPT, 64), "req-b": (PROMPT, 1)}),
    }
    runtime.deactivate()

    probe = runtime.activate(sys.argv[2])
    result["apart"] = path_case({"req-a": (PROMPT, 64), "req-b": ([p + 100 for p in PROMPT], 1)})
    runtime.deactivate()

    if len(sys.argv) > 3:
        probe = runtime.activate(sys.argv[3])
        result["device"] = {**device_case(), "ledgers_off": sorted(probe.ledgers_off), "probe_on": probe.ledger_on}
        runtime.deactivate()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
