"""Prefill batches' request rows, written by SGLang's own `write_cache_indices`, with the probe in a
fresh process.

Each prefill is SGLang's `alloc_for_extend` (what `ScheduleBatch.prepare_for_extend` calls, given the
batch fields it sets there; tests/support/prefill_batches.py): rows from the real `ReqToTokenPool`,
slots from the real `TokenToKVPoolAllocator` (page size 1) or `PagedTokenToKVPoolAllocator` (page
size 16, `last_loc` from the prefixes), prefixes matched in the real `RadixCache` and locked as the
scheduler's `PrefillAdder` locks them, then `write_cache_indices`. A first batch finishes into the
tree (`release_kv_cache`); a second, sharing its prefixes, is live while the rolling census runs.
SGLang 0.5.23 in every case but one, which runs 0.5.9 (the writer in mem_cache/common.py).

`write_cache_indices` takes one of two branches. Where `support_triton(attention backend)` is false
(SGLang's CPU engine, `torch_native`) it calls `ReqToTokenPool.write` twice per request, which the
probe hooks. Everywhere else (any GPU server) it launches the Triton kernel
`write_req_to_token_pool_triton` and calls no pool method. That kernel needs a GPU driver (on this
machine Triton says "0 active drivers"), so the "triton" cases take the branch by setting the
module's `support_triton` to say yes and stand in for the kernel object, only it, with a torch loop
doing what its source does (`WriteReqToTokenPoolStandIn`: each program loads the prefix through
the pointer the host passed, then copies its share of `out_cache_loc`). tests/gpu/harness/prefill_rows.py
runs the real kernel on a GPU.

The rolling census runs every 0.2 s; the workload waits for three of them taken while the second
batch is live (counted in the probe's own state, not by time).
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import REPO, SUPPORT, run_for_result, sglang_env

from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

WORKLOAD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
trace, page_size, branch, ledger_kind, support = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
sys.path.insert(0, support)
if ledger_kind == "device":  # the GPU ledger's torch path, on CPU tensors
    from kvdoctor.probe.ledgers import arrays, slots
    slots.arrays_for = lambda device: arrays.DeviceArrays("cpu")
from kvdoctor.probe.core import runtime
probe = runtime.activate(trace)
from prefill_batches import PrefillBatches, live_censuses, ownership
from kvdoctor.probe.engines.sglang.state import sglang_state

batches = PrefillBatches(page_size, "cpu", "torch_native")
stand_in = batches.stand_in_for_the_kernel() if branch == "triton" else None
hooked = getattr(batches.writer.write_cache_indices, "__kvdoctor_role__", None)
second = batches.run_two_batches()
prefilled = time.monotonic()
state = sglang_state(probe)
result = ownership(state.ledgers[id(batches.allocator)], batches, second)
live = live_censuses(state, prefilled, len(second))
batches.finish(second)
runtime.deactivate()
print("RESULT " + json.dumps({
    **result,
    "hooked": hooked,
    "kernel_launches": stand_in.launches if stand_in else 0,
    "live_censuses": live,
    "sglang_unaccounted": batches.unaccounted(),
}), flush=True)
"""


def _run(tmp_path, page_size: int, branch: str, ledger: str = "host", release: str = "0.5.23") -> tuple[list, dict]:
    trace = str(tmp_path / f"prefill-{release}-{page_size}-{branch}-{ledger}.kvtrace.json")
    env = {**sglang_env(release), "KVDOCTOR_ROLLING_CENSUS_S": "0.2"}
    # sglang_env puts an older release's folder in place of PYTHONPATH: the caller's entries (the
    # checkout under test) stay in front of it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-c", WORKLOAD, trace, str(page_size), branch, ledger, SUPPORT]
    result = run_for_result(command, env=env, cwd=REPO, timeout=300)
    return list(iter_events(trace)), result


@pytest.mark.parametrize(
    "release,page_size,branch,ledger",
    [
        ("0.5.23", 1, "triton", "host"),
        ("0.5.23", 16, "triton", "host"),
        ("0.5.23", 1, "triton", "device"),
        ("0.5.23", 1, "fallback", "host"),
        ("0.5.23", 16, "fallback", "host"),
        # mem_cache/common.py's writer, as 0.5.3.post2 - 0.5.15 have it (page size 1: 0.5.9's paged
        # allocator takes its slots with a Triton kernel of its own, which has no CPU path)
        ("0.5.9", 1, "triton", "host"),
    ],
)
def test_a_prefill_batchs_rows_are_owned_while_its_requests_are_live(tmp_path, release, page_size, branch, ledger):
    events, result = _run(tmp_path, page_size, branch, ledger, release)
    assert result["hooked"] == "req_write_extend"
    assert result["kernel_launches"] == (2 if branch == "triton" else 0)  # the branch SGLang took, each prefill
    # second-0 and second-1 begin with 32 and 38 tokens of the first batch's (whole pages at size 16)
    assert result["prefix_lens"] == ([32, 32, 0] if page_size == 16 else [32, 38, 0]) and result["seq_lens"] == [51, 53, 29]
    # Every slot the live rows point at past their prefix is owned by that row in the ledger, and no
    # other slot is owned; the prefixes are the tree's. Before, on the Triton branch, no prefill slot
    # had an owner: all 63 (page size 1) and 6 pages (page size 16) mismatched.
    assert result["owner_mismatches"] == 0 and result["owned_pages"] == result["expected_owned_pages"] > 0, result
    assert result["prefix_not_tree"] == 0
    # Taken while all three requests were live: none of their slots is an orphan. Before, on the
    # Triton branch, these censuses counted every slot the requests took at prefill (63 and 96).
    live = result["live_censuses"]
    assert len(live) >= 3 and [c["orphan_slots"] for c in live] == [0] * len(live), live
    # The fallback branch wrote each row through the hooked ReqToTokenPool.write as well: applied
    # twice, the same ownership is counted once, with no violation.
    pages = sum(-(-(seq - prefix) // page_size) for seq, prefix in zip(result["seq_lens"], result["prefix_lens"], strict=True))
    assert result["owned_pages"] == pages and all(c["owned_slots"] == pages * page_size for c in live), (live, pages)
    assert not [e for e in events if e.name == schema.VIOLATION]
    assert result["sglang_unaccounted"] == 0
