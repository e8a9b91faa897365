"""Speculative decoding on SGLang 0.5.23's own decode preparation, with the probe in a fresh process.

Each decode step is SGLang's `ScheduleBatch.prepare_for_decode` for an EAGLE batch:
`spec_prepare_for_decode` -> `eagle_prepare_for_decode` -> `alloc_for_spec_decode`, which takes
the draft tokens' slots from the real `TokenToKVPoolAllocator` (page size 1) or
`PagedTokenToKVPoolAllocator` (page size 16, `last_loc` from `get_last_loc`) beside the real
`RadixCache`, and writes them into the real `ReqToTokenPool`'s rows with
`assign_req_to_token_pool_func`, not with `ReqToTokenPool.write`. Requests finish through SGLang's
`release_kv_cache` (the tree's checkpoint, the row's frees, the over-allocated draft slots freed by
`_release_overallocated_kv_indices`, the row given back).

One part is stood in: `assign_req_to_token_pool_func` launches the Triton kernel
`assign_req_to_token_pool[(batch_size,)]`, which needs a GPU driver (on this machine Triton says
"0 active drivers"); SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) would call sgl-kernel's
`assign_req_to_token_pool_cpu` instead, and sgl-kernel is not installed (allocation.py imports it at
load, so that setting cannot even import the module). There is no torch fallback in 0.5.23. So only
the kernel object is replaced, by a torch loop doing exactly what its source does: program `pid`
copies `out_cache_loc[offset : offset + end - start]` into `req_to_token[req_pool_indices[pid],
start:end]`, `offset` being the sum of `end - start` over the programs before it. The hooked
function around it is SGLang's own. Also set in-process, as a server would publish them: the server
arguments (EAGLE, 3 steps, top-k 1, 4 draft tokens; the `torch_native` attention backend, whose
`get_last_loc` is the torch one) and the verify step's bookkeeping (accepted tokens committed, the
scheduler's `kv_committed_len += accepted`).

The rolling census runs every 0.2 s; the workload waits for four of them to be taken while every
request is live (counted in the probe's own state, not by time), then finishes the requests.
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import REPO, error_findings, run_for_result

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

WORKLOAD = r"""
import json, random, sys, time, warnings
warnings.filterwarnings("ignore")
from array import array
trace, page_size, rows_seen, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
from kvdoctor.probe.maps import loader as maps
from kvdoctor.probe.core import runtime
if rows_seen == "unhooked":  # the map of a release with no hookable row writer (0.5.3.post2 - 0.5.4.post1 launch the kernel in place)
    load_maps = maps.load_maps
    def without_row_writer(path):
        loaded = load_maps(path)
        for probe_map in loaded:
            probe_map.functions = [f for f in probe_map.functions if f.role != "req_write_spans"]
        return loaded
    maps.load_maps = without_row_writer
probe = runtime.activate(trace)
import torch
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs
get_context().set_server_args(ServerArgs(
    model_path="unused", device="cpu", attention_backend="torch_native", page_size=page_size,
    speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
))
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache import allocation, common
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from kvdoctor.probe.engines.sglang.state import sglang_state

import os
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "support"))  # run from the repository's root
from triton_standins import Launch, assign_req_to_token_pool

allocation.assign_req_to_token_pool = Launch(assign_req_to_token_pool)
hooked = getattr(allocation.assign_req_to_token_pool_func, "__kvdoctor_role__", None)

size = 4096
req_pool = ReqToTokenPool(size=16, max_context_len=512, device="cpu", enable_memory_saver=False)
if page_size == 1:
    allocator = TokenToKVPoolAllocator(size, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
else:
    allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=page_size))
reqs = [Req(f"spec-{n}", "", array("q", range(100 + 50 * n, 120 + 51 * n)), SamplingParams(max_new_tokens=256)) for n in range(4)]
for req in reqs:
    req.sampling_params.normalize(None)
req_pool.alloc(reqs)
for req in reqs:  # prefill: the slots, written into the row as write_cache_indices does without Triton
    n = len(req.origin_input_ids)
    if page_size == 1:
        slots = allocation.alloc_token_slots(tree, n)
    else:
        zero = torch.zeros(1, dtype=torch.int64)
        slots = allocation.alloc_paged_token_slots_extend(tree, zero, zero, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)
    req_pool.write((req.kv.req_pool_idx, slice(0, n)), slots.to(torch.int32))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = n
    req.output_ids.append(7)
batch = ScheduleBatch(reqs=reqs, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, tree_cache=tree, device="cpu",
                      spec_algorithm=SpeculativeAlgorithm.EAGLE)
batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, vocab_size=512)
batch.req_pool_indices = torch.tensor([req.kv.req_pool_idx for req in reqs], dtype=torch.int64)
draws = random.Random(0)
for step in range(12):  # draft, verify, commit what was accepted; rejected draft slots stay in the row
    batch.prepare_for_decode()
    for req in reqs:
        accepted = draws.randint(1, 4)
        req.kv.kv_committed_len += accepted
        req.output_ids.extend([7] * accepted)

state = sglang_state(probe)
decoded = time.monotonic()
live = {}  # snapshot time -> a rolling census taken after the decode steps, every request live
deadline = decoded + 120
while time.monotonic() < deadline and len(live) < 4:
    for rolling in list(state.rolling.values()):
        census, taken = rolling.last, rolling.last_s
        if census is not None and taken > decoded and census["live_requests"] == len(reqs):
            live[taken] = census
    time.sleep(0.05)
probe.emitter.flush()

ps = page_size
held = {req.rid: req.kv.kv_allocated_len for req in reqs}
draft_tails = {}  # what _release_overallocated_kv_indices frees: the row past the page-aligned committed tokens
for req in reqs:
    start = -(-req.owned_kv_len() // ps) * ps
    tail = req_pool.req_to_token[req.kv.req_pool_idx, start : req.kv.kv_allocated_len]
    if tail.numel():
        draft_tails[req.rid] = sorted(int(s) for s in tail)
if fault == "draft-slots-kept":  # the verify steps' rejected draft slots are never given back
    common._release_overallocated_kv_indices = lambda *args, **kwargs: None
for req in reqs:
    req.finished_reason = "stop"
    common.release_kv_cache(req, tree, checkpoint=True)
runtime.deactivate()
print("RESULT " + json.dumps({
    "hooked": hooked,
    "live_censuses": [{k: c[k] for k in ("orphan_slots", "owned_slots", "live_requests")} | {"judged": c.get("judged", True)} for c in live.values()],
    "held": held,
    "draft_tails": draft_tails,
    "sglang_unaccounted": size - int(allocator.available_size()) - int(tree.evictable_size()) - int(tree.protected_size()),
}), flush=True)
"""


def _run(tmp_path, page_size: int, rows_seen: str, fault: str) -> tuple[list, dict]:
    trace = str(tmp_path / f"spec-{page_size}-{rows_seen}-{fault}.kvtrace.json")
    env = {**os.environ, "KVDOCTOR_ROLLING_CENSUS_S": "0.2"}
    command = [sys.executable, "-c", WORKLOAD, trace, str(page_size), rows_seen, fault]
    result = run_for_result(command, env=env, cwd=REPO, timeout=300)
    return list(iter_events(trace)), result


def _coverage(events: list) -> dict:
    lines = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "coverage"]
    assert lines, "no coverage line"
    return lines[-1]


def _stopped_under_load(events: list) -> list:
    """The trace of a server stopped while the four requests were decoding: up to the last rolling
    census taken with them live, which is then the verdict."""
    last = max(e.ts for e in events if e.name == schema.CENSUS and e.args.get("reason") == "rolling" and e.args.get("live_requests") == 4)
    return [e for e in events if e.ts <= last]


@pytest.mark.parametrize("page_size", [1, 16])
def test_speculative_rows_are_read_and_a_clean_run_is_clean(tmp_path, page_size):
    events, result = _run(tmp_path, page_size, "hooked", "none")
    # Taken while all four requests were mid-decode: every slot they hold is theirs, none an orphan.
    # Before, the slots written by the kernel were "allocated, never written": 146 (page size 1) and
    # 128 (page size 16) orphans of live requests.
    live = result["live_censuses"]
    assert len(live) >= 3 and all(c["judged"] for c in live), live
    assert [c["orphan_slots"] for c in live] == [0] * len(live), live
    assert all(c["owned_slots"] == sum(result["held"].values()) for c in live), (live, result["held"])
    assert result["hooked"] == "req_write_spans"
    coverage = _coverage(events)
    assert coverage["state"] == "on" and coverage["speculative"] == "EAGLE", coverage
    assert coverage["speculative_row_writers"] == ["sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func"]
    busy = _stopped_under_load(events)
    assert error_findings(busy) == [], [f.message for f in error_findings(busy)]
    assert error_findings(events) == [] and result["sglang_unaccounted"] == 0
    assert not [e for e in events if e.name == schema.VIOLATION]


@pytest.mark.parametrize("page_size", [1, 16])
def test_rejected_draft_slots_never_freed_are_named_with_their_request(tmp_path, page_size):
    events, result = _run(tmp_path, page_size, "hooked", "draft-slots-kept")
    planted = result["draft_tails"]
    total = sum(len(slots) for slots in planted.values())
    assert total > 0 and result["sglang_unaccounted"] == total  # SGLang's own idle check counts them too
    assert [c["orphan_slots"] for c in result["live_censuses"]] == [0] * len(result["live_censuses"])
    # named at each request's release, with that request, slot for slot
    released = [e.args for e in events if e.name == schema.VIOLATION and e.args.get("kind") == schema.ORPHAN_SLOTS]
    assert {v["request"].split("rid ")[1].rstrip(")"): sorted(v["slot_ids"]) for v in released} == planted
    assert all(v["when"] == "release" for v in released)
    (finding,) = error_findings(events)
    assert finding.kind == schema.ORPHAN_SLOTS and finding.count == total
    assert sorted(finding.evidence["slot_ids"]) == sorted(s for slots in planted.values() for s in slots)
    assert "alloc_for_spec_decode" in finding.message and "rid spec-" in finding.message


def test_a_release_whose_map_hooks_no_speculative_row_writer_says_so_and_judges_nothing(tmp_path):
    """The same run where the map names no `req_write_spans` function (as on the releases before
    0.5.4.post2, whose workers launch the kernel in place): the engine's `spec_algorithm` is read
    from the batch on the callers' stack, and its ledger is said not judged, with the reason."""
    events, result = _run(tmp_path, 1, "unhooked", "none")
    assert result["hooked"] is None
    coverage = _coverage(events)
    assert coverage["state"] == "partial" and coverage["speculative"] == "EAGLE" and coverage["speculative_row_writers"] == []
    assert (
        "speculative decoding (EAGLE) writes request rows with a kernel the probe map for this release does not hook" in coverage["reason"]
    )
    live = result["live_censuses"]
    assert live and all(c["judged"] is False for c in live), live
    assert max(c["orphan_slots"] for c in live) > 0  # what the ledger would have said, not a verdict
    assert error_findings(_stopped_under_load(events)) == [] and error_findings(events) == []
    partial = [f for f in analyze(iter(events)).findings if f.kind == schema.PROBE_PARTIAL]
    assert any("speculative decoding (EAGLE)" in f.message for f in partial), [f.message for f in partial]
