"""EAGLE decode on SGLang 0.5.15, the last release whose `eagle_prepare_for_decode` records an
unaligned `kv_allocated_len` at page size > 1 (sglang PR#31616, in 0.5.16 and on, rounds it up to
the page), with the probe in a fresh process.

PR#31616 calls the unaligned length a "stranded-tail leak": the paged allocator hands out whole
pages, so the last page's slots past `kv_allocated_len` are held but not recorded. On the real
classes that tail is not a leak at release: `PagedTokenToKVPoolAllocator.free` frees every page
any freed index falls in, `release_kv_cache` frees `req_to_token[ceil_align(committed):
kv_allocated_len]` and the tree's `cache_finished_req` the committed tail's page, so the page
holding the stranded tail is given back whole. SGLang's own count agrees (nothing unaccounted
after the releases, 20 seeds each at page sizes 4, 16 and 64). This case holds the probe to the
same verdict: the tails exist (pages owned beyond what `kv_allocated_len` covers, counted by the
live censuses), and nothing is named, neither while the requests decode nor at their release.

Each decode step is SGLang's `ScheduleBatch.prepare_for_decode` -> `spec_prepare_for_decode` ->
`eagle_prepare_for_decode` on the real `PagedTokenToKVPoolAllocator` (page size 16), `RadixCache`
and `ReqToTokenPool`; requests finish through SGLang's `release_kv_cache`. Two Triton kernels are
stood in, as this machine has no GPU driver: `assign_req_to_token_pool` by a torch loop doing what
its source does (as in test_spec_decode.py), and the paged allocator's `alloc_extend_kernel` by
SGLang's own `alloc_extend_naive` from the same module (0.5.15 launches the kernel on every
device; 0.5.22 and on call `alloc_extend_naive` on CPU). The rows are written through SGLang's
`assign_req_to_token_pool_func`, which the 0.5.14 map hooks in `triton_ops.cache_locs` and
`eagle_prepare_for_decode` imports through `spec_utils`.
"""

from __future__ import annotations

import sys

from conftest import REPO, run_for_result, sglang_env

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

WORKLOAD = r"""
import json, random, sys, time, warnings
warnings.filterwarnings("ignore")
from array import array
trace, page_size = sys.argv[1], int(sys.argv[2])
from kvdoctor.probe.core import runtime
probe = runtime.activate(trace)
import torch
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(
    model_path="dummy", device="cpu", attention_backend="torch_native", page_size=page_size,
    speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
))
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache import common
from sglang.srt.mem_cache.allocator import paged
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative import spec_utils
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.triton_ops import cache_locs
from kvdoctor.probe.engines.sglang.state import sglang_state

import os
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "support"))  # run from the repository's root
from triton_standins import Launch, assign_req_to_token_pool

class AllocExtend:
    # The Triton kernel `alloc_extend_kernel[(bs,)](...)` as SGLang's own torch twin in paged.py.
    def __getitem__(self, grid):
        def launch(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
            paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device)
        return launch

cache_locs.assign_req_to_token_pool = Launch(assign_req_to_token_pool)
paged.alloc_extend_kernel = AllocExtend()
hooked = getattr(spec_utils.assign_req_to_token_pool_func, "__kvdoctor_role__", None)

size = 4096
req_pool = ReqToTokenPool(size=16, max_context_len=512, device="cpu", enable_memory_saver=False)
allocator = paged.PagedTokenToKVPoolAllocator(size, page_size, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=page_size))
reqs = [Req(f"spec-{n}", "", array("q", range(100 + 50 * n, 120 + 51 * n)), SamplingParams(max_new_tokens=256)) for n in range(4)]
for req in reqs:
    req.sampling_params.normalize(None)
req_pool.alloc(reqs)
for req in reqs:  # prefill: the slots, written into the row as write_cache_indices does without Triton
    n = len(req.origin_input_ids)
    zero = torch.zeros(1, dtype=torch.int64)
    slots = common.alloc_paged_token_slots_extend(tree, zero, zero, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)
    req_pool.write((req.req_pool_idx, slice(0, n)), slots.to(torch.int32))
    req.kv_committed_len = req.kv_allocated_len = n
    req.output_ids.append(7)
batch = ScheduleBatch(reqs=reqs, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, tree_cache=tree, device="cpu",
                      spec_algorithm=SpeculativeAlgorithm.EAGLE)
batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, vocab_size=512)
batch.req_pool_indices = torch.tensor([req.req_pool_idx for req in reqs], dtype=torch.int64)
draws = random.Random(0)
for step in range(12):  # draft, verify, commit what was accepted
    batch.prepare_for_decode()
    for req in reqs:
        accepted = draws.randint(1, 4)
        req.kv_committed_len += accepted
        req.output_ids.extend([7] * accepted)

state = sglang_state(probe)
decoded = time.monotonic()
live = {}  # snapshot time -> a rolling census taken after the decode steps, every request live
deadline = decoded + 120
while time.monotonic() < deadline and len(live) < 3:
    for rolling in list(state.rolling.values()):
        census, taken = rolling.last, rolling.last_s
        if census is not None and taken > decoded and census["live_requests"] == len(reqs):
            live[taken] = census
    time.sleep(0.05)
allocated = {req.rid: req.kv_allocated_len for req in reqs}
in_use = size - int(allocator.available_size())
for req in reqs:
    req.finished_reason = "stop"
    common.release_kv_cache(req, tree)
runtime.deactivate()
print("RESULT " + json.dumps({
    "hooked": hooked,
    "live_censuses": [{k: c[k] for k in ("orphan_slots", "owned_slots", "live_requests")} | {"judged": c.get("judged", True)} for c in live.values()],
    "allocated": allocated,
    "in_use": in_use,
    "sglang_unaccounted": size - int(allocator.available_size()) - int(tree.evictable_size()) - int(tree.protected_size()),
}), flush=True)
"""


def test_unaligned_kv_allocated_len_before_pr31616_holds_tails_freed_whole_at_release(tmp_path):
    page_size = 16
    trace = str(tmp_path / "spec-0.5.15.kvtrace.json")
    env = {**sglang_env("0.5.15"), "KVDOCTOR_ROLLING_CENSUS_S": "0.2"}
    result = run_for_result([sys.executable, "-c", WORKLOAD, trace, str(page_size)], env=env, cwd=REPO, timeout=300)
    events = list(iter_events(trace))
    assert result["hooked"] == "req_write_spans"  # reached through spec_utils' re-export
    # the pre-PR#31616 path ran: lengths off the page, and each request's last page held past them
    allocated = result["allocated"]
    assert any(n % page_size for n in allocated.values()), allocated
    whole_pages = sum(-(-n // page_size) * page_size for n in allocated.values())
    assert result["in_use"] == whole_pages > sum(allocated.values())
    live = result["live_censuses"]
    assert len(live) >= 2 and all(c["judged"] for c in live), live
    assert all(c["orphan_slots"] == 0 and c["owned_slots"] == whole_pages for c in live), (live, whole_pages)
    # at release the tails go back with their pages: SGLang's own count and the probe agree
    assert result["sglang_unaccounted"] == 0
    assert not [e for e in events if e.name == schema.VIOLATION]
    assert [f for f in analyze(iter(events)).findings if f.severity == "error"] == []
