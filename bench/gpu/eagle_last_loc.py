"""Issue #31 on SGLang 0.5.23's EAGLE v2 decode step: the draft/verify path's `last_loc` and
`kv_allocated_len` on paged allocation (page size 16, top-k 1), checked before the kernel.

Each decode step is SGLang's own `ScheduleBatch.prepare_for_decode` -> `spec_prepare_for_decode` ->
`eagle_prepare_for_decode` -> `alloc_for_spec_decode`: `cur_kv_lens` = the requests'
`kv_allocated_len`, `last_loc = get_last_loc(req_to_token, req_pool_indices, cur_kv_lens)` (the Triton
`get_last_loc_triton` with the `triton` attention backend), the real `PagedTokenToKVPoolAllocator`'s
`alloc_extend` (Triton `alloc_extend_kernel`) and `assign_req_to_token_pool_func` (Triton
`assign_req_to_token_pool`) writing the rows of the real `ReqToTokenPool`. The verify step's slots are
then taken from the rows as SGLang's `eagle_prepare_for_verify` takes them
(`assign_extend_cache_locs_uniform_func`: `req_to_token[row, seq_len : seq_len + 4]`) and the draft
tokens' K/V written there into the real `MHATokenToKVPool` with `set_kv_buffer`, as the attention
layer does, so a bad slot is a memory access `compute-sanitizer --tool memcheck` sees. Requests
finish through SGLang's `release_kv_cache` into the real `RadixCache`.

The scenario (every case): a prefill batch R0, R1, A (20, 37 and 44 tokens; A's last page holds 12
of them); A finishes at its prefill and is released (its two whole pages kept by the tree, the tail
page freed); a prefill batch C, B (24 and 40 tokens) takes A's row for B (rows are handed out last
freed first, and never cleared) and A's freed page for C (pages likewise); then EAGLE decode steps
for R0, R1, C, B, each with its verify write and a commit of 1-4 accepted tokens; then every
request is released.

--case clean       as above: no finding; memcheck 0 errors.
--case reused-row  B's `kv_allocated_len` is left at A's 44 after its prefill, as a missing update
                   would leave it: `get_last_loc` reads row[43], A's entry, in the page C now holds.
                   Named before the kernel (`stale_last_loc`, the EAGLE site on the stack, C as the
                   page's holder; B as the request that passed it where the ledger is on the host:
                   the device ledger keeps pages, not the rows each last_loc came from). The harm, measured from SGLang's tensors without the probe's verdict: slots
                   held by two live requests' rows (B's row[40:48] and C's row[8:16]), the verify
                   writing B's draft K/V over C's.
--case oor         R1's row entry at `kv_allocated_len - 1` holds size + page_size (out of range):
                   named before the kernel (`index_out_of_range`, the value itself, at the EAGLE site); without a fix the verify write is an illegal access under
                   memcheck; with `--fix clamp-last-loc` it stays in the buffer (memcheck clean).

Stood in, and why: the server arguments are SGLang's `ServerArgs` published with
`get_context().set_server_args` (EAGLE, 3 steps, top-k 1, 4 draft tokens; no model); the verify's
accept/commit (`kv_committed_len += accepted`, seeded draws) and the prefill's row writes
(`ReqToTokenPool.write` of `alloc_paged_token_slots_extend`'s slots, as `write_cache_indices` does)
are the harness's, as in tests/integration/test_spec_decode.py. `--cpu` runs the same path on CPU
with the Triton kernels stood in by torch (`assign_req_to_token_pool` by a loop doing what its
source does; 0.5.23's allocator runs its own `alloc_extend_naive` on CPU; the verify slots gathered
from the rows), a check of the plumbing (tests/integration/test_eagle_last_loc.py), not a GPU result.

On the device machine: `bash bench/gpu/run_eagle_last_loc.sh` (README.md says what travels).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import types
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "support"))

import common

CASES = ("clean", "reused-row", "oor")
PAGE, SIZE, DRAFT, HEADS, DIM, LAYERS = 16, 4096, 4, 8, 128, 2
LENGTHS = {"R0": 20, "R1": 37, "A": 44, "C": 24, "B": 40}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=CASES, action="append", required=True, help="repeatable: each case its own probe and pools")
    ap.add_argument("--cpu", action="store_true", help="a dry run on CPU, the Triton kernels stood in by torch")
    ap.add_argument("--fix", action="append", default=[])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--traces", default="", help="folder for the cases' traces (default: a temporary one)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    traces = a.traces or tempfile.mkdtemp(prefix="eagle-last-loc-")
    os.makedirs(traces, exist_ok=True)
    set_up(a.cpu)
    results = {}
    for case in a.case:
        tag = case + "".join(f"+{f}" for f in a.fix)
        trace = os.path.join(traces, f"{tag}.trace.json")
        results[case] = run_case(a, case, trace)
        results[case]["findings"] = findings(trace)
        results[case]["violations"] = violations(trace)
        results[case]["trace"] = trace
        results[case]["verdict"] = judge(case, results[case], a.fix)
    out = {"cpu_dry_run": a.cpu, "fixes": a.fix, "cases": results, "ok": all(all(r["verdict"].values()) for r in results.values())}
    print("RESULT " + json.dumps(out), flush=True)
    if a.out:
        common.write_json(a.out, out)
    return 0 if out["ok"] else 1


def set_up(cpu: bool) -> None:
    """SGLang's server arguments, published as a server publishes them (before the probe: the
    arguments do not change what is hooked)."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    get_context().set_server_args(
        ServerArgs(
            model_path="unused",
            device="cpu" if cpu else "cuda",
            attention_backend="torch_native" if cpu else "triton",
            page_size=PAGE,
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=DRAFT,
        )
    )


def cpu_kernels() -> types.SimpleNamespace:
    """The Triton kernels a CUDA machine launches, in torch, for `--cpu`."""
    import torch
    from sglang.srt.mem_cache import allocation
    from triton_standins import Launch, assign_req_to_token_pool  # tests/support: the one torch copy

    allocation.assign_req_to_token_pool = Launch(assign_req_to_token_pool)

    def verify_locs(req_pool_indices, req_to_token, start_offset, batch_size, draft_token_num, device):
        cols = start_offset.view(-1, 1).long() + torch.arange(draft_token_num, device=device)
        return req_to_token[req_pool_indices.long().view(-1, 1), cols].reshape(-1).to(torch.int64)

    return types.SimpleNamespace(verify_locs=verify_locs)


def run_case(a: argparse.Namespace, case: str, trace: str) -> dict:
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(trace, fixes=a.fix)
    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache import allocation
    from sglang.srt.mem_cache import common as mem_common
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from kvdoctor.probe.engines.sglang.state import sglang_state

    dev = "cpu" if a.cpu else "cuda"
    if a.cpu:
        verify_locs = cpu_kernels().verify_locs
    else:
        from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_uniform_func as verify_locs
    kv = MHATokenToKVPool(
        size=SIZE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device=dev,
        enable_memory_saver=False,
    )
    allocator = PagedTokenToKVPoolAllocator(SIZE, PAGE, dtype=torch.bfloat16, device=dev, kvcache=kv, need_sort=False)
    req_pool = ReqToTokenPool(size=16, max_context_len=512, device=dev, enable_memory_saver=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=PAGE))
    kv_rows = kv.k_buffer[0].shape[0]

    def write_kv(slots) -> None:
        """The K/V of the tokens at `slots`, written as the attention layer writes them."""
        k = torch.randn(slots.numel(), HEADS, DIM, dtype=torch.bfloat16, device=dev)
        for layer_id in range(LAYERS):
            kv.set_kv_buffer(types.SimpleNamespace(layer_id=layer_id), slots, k, k)

    def make(name: str, first: int) -> Req:
        req = Req(name, "", array("q", range(first, first + LENGTHS[name])), SamplingParams(max_new_tokens=256))
        req.sampling_params.normalize(None)
        return req

    def prefill(reqs: list[Req]) -> None:
        """A prefill batch: rows, then the slots of every request's tokens, written into its row."""
        req_pool.alloc(reqs)
        lens = [len(r.origin_input_ids) for r in reqs]
        n = sum(lens)
        zeros = torch.zeros(len(reqs), dtype=torch.int64)
        seq = torch.tensor(lens, dtype=torch.int64)
        slots = allocation.alloc_paged_token_slots_extend(
            tree, zeros.to(dev), zeros, seq.to(dev), seq, torch.full((len(reqs),), -1, dtype=torch.int64, device=dev), n
        )
        at = 0
        for req, length in zip(reqs, lens, strict=True):
            req_pool.write((req.kv.req_pool_idx, slice(0, length)), slots[at : at + length].to(torch.int32))
            req.kv.kv_committed_len = req.kv.kv_allocated_len = length
            req.output_ids.append(7)
            at += length
        write_kv(slots)

    def rows_of(reqs: list[Req]) -> dict[str, list[int]]:
        table = req_pool.req_to_token.cpu()
        return {r.rid: table[r.kv.req_pool_idx, : r.kv.kv_allocated_len].tolist() for r in reqs}

    result: dict = {
        "case": case,
        "device": "cpu (stand-ins)" if a.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sglang": __import__("sglang").__version__,
        "fixes": a.fix,
        "size": SIZE,
        "page_size": PAGE,
        "kv_rows": kv_rows,
        "alloc_extend_hooked_as": getattr(PagedTokenToKVPoolAllocator.alloc_extend, "__kvdoctor_role__", None),
        "get_last_loc_hooked_as": getattr(allocation.get_last_loc, "__kvdoctor_role__", None),
        "alloc_extend_impl": "triton alloc_extend_kernel" if allocator.use_triton_kernels else "alloc_extend_naive",
        "set_kv_buffer_impl": set_kv_buffer_impl(a.cpu),
    }
    r0, r1, a_req = make("R0", 100), make("R1", 300), make("A", 500)
    prefill([r0, r1, a_req])
    a_row = a_req.kv.req_pool_idx
    a_rows = rows_of([a_req])["A"]
    a_req.finished_reason = "stop"  # A finishes at its prefill
    mem_common.release_kv_cache(a_req, tree, checkpoint=True)
    free_head = int(allocator.free_pages[0])
    result["A"] = {"row": a_row, "len": LENGTHS["A"], "tail_page": a_rows[-1] // PAGE, "tail_page_freed": free_head == a_rows[-1] // PAGE}
    c_req, b_req = make("C", 700), make("B", 900)
    prefill([c_req, b_req])
    result["B_row"], result["C_row"] = b_req.kv.req_pool_idx, c_req.kv.req_pool_idx
    result["B_takes_A_row"] = b_req.kv.req_pool_idx == a_row
    result["C_pages"] = sorted({s // PAGE for s in rows_of([c_req])["C"]})
    if case == "reused-row":  # B's record not brought to its own prefill: A's length is left
        b_req.kv.kv_allocated_len = LENGTHS["A"]
    elif case == "oor":  # R1's row entry at kv_allocated_len - 1: one page past the buffer's end
        req_pool.req_to_token[r1.kv.req_pool_idx, r1.kv.kv_allocated_len - 1] = SIZE + PAGE
    reqs = [r0, r1, c_req, b_req]
    batch = ScheduleBatch(
        reqs=reqs,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=tree,
        device=dev,
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
    )
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, vocab_size=512)
    batch.req_pool_indices = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64, device=dev)
    result["last_loc_read"] = {r.rid: int(req_pool.req_to_token[r.kv.req_pool_idx, r.kv.kv_allocated_len - 1]) for r in reqs}
    draws = random.Random(0)
    steps = []
    for step in range(a.steps):  # draft, verify, commit what was accepted
        batch.prepare_for_decode()
        committed = torch.tensor([r.kv.kv_committed_len for r in reqs], dtype=torch.int64, device=dev)
        locs = verify_locs(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=req_pool.req_to_token,
            start_offset=committed,
            batch_size=len(reqs),
            draft_token_num=DRAFT,
            device=dev,
        )
        if not a.cpu:
            torch.cuda.synchronize()
        if probe is not None:  # the ledger's findings reach the trace before the verify's KV write is launched
            for ledger in sglang_state(probe).ledgers.values():
                ledger.poll(force=True)
            probe.emitter.flush()
        locs_host = locs.cpu().tolist()
        rows = rows_of(reqs)
        owners: dict[int, set[str]] = {}
        for rid, slots in rows.items():
            for slot in slots:
                owners.setdefault(slot, set()).add(rid)
        shared = {s: sorted(o) for s, o in owners.items() if len(o) > 1}
        steps.append(
            {
                "kv_allocated_len": {r.rid: r.kv.kv_allocated_len for r in reqs},
                "kv_committed_len": {r.rid: r.kv.kv_committed_len for r in reqs},
                "verify_slots_out_of_range": sum(1 for s in locs_host if s < 0 or s >= kv_rows),
                "verify_slots_max": max(locs_host),
                # SGLang's own rows: a slot in two live requests' rows [0, kv_allocated_len)
                "slots_in_two_rows": len(shared),
                "slots_in_two_rows_by": sorted({"+".join(o) for o in shared.values()}),
                "verify_writes_into_another_rows_slots": sum(
                    1
                    for i, r in enumerate(reqs)
                    for s in locs_host[i * DRAFT : (i + 1) * DRAFT]
                    if any(o != r.rid for o in owners.get(s, ()))
                ),
            }
        )
        print(f"step {step} " + json.dumps(steps[-1]), flush=True)
        if step == 0 and a.out:  # what was named before the first write, kept should the write kill the process
            common.write_json(a.out, {"partial": True, "cases": {case: {**result, "steps": steps, "findings": findings(trace)}}})
        try:
            write_kv(locs)  # the verify forward's K/V for the draft tokens
            if not a.cpu:
                torch.cuda.synchronize()
        except (RuntimeError, IndexError) as exc:  # an illegal access (CUDA) or an index past the buffer (CPU)
            result["kv_write_error"] = f"{type(exc).__name__}: {exc}"[:500]
            print("kv write failed: " + result["kv_write_error"], flush=True)
            break
        for r in reqs:
            accepted = draws.randint(1, DRAFT)
            r.kv.kv_committed_len += accepted
            r.output_ids.extend([7] * accepted)
    result["steps"] = steps
    if "kv_write_error" not in result:  # after an illegal access the CUDA context is gone: nothing more runs on it
        for r in reqs:
            r.finished_reason = "stop"
            mem_common.release_kv_cache(r, tree, checkpoint=True)
        if not a.cpu:
            torch.cuda.synchronize()
        result["completed"] = True
        result["sglang_unaccounted"] = SIZE - int(allocator.available_size()) - int(tree.evictable_size()) - int(tree.protected_size())
    if probe is not None:
        result["probe"] = {"ledger_on": probe.ledger_on, "failures": probe.failures, "fix_counts": dict(probe.fix_counts)}
    runtime.deactivate()
    return result


def set_kv_buffer_impl(cpu: bool) -> str:
    """Which write `set_kv_buffer` takes on this machine (memory_pool.py's own test)."""
    if cpu:
        return "torch index_put (cpu)"
    from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache

    row_bytes = HEADS * DIM * 2
    return "jit store_cache" if can_use_store_cache(row_bytes, row_bytes) else "torch index_put fallback"


def findings(trace: str) -> list[dict]:
    """The trace's findings as `kvdoctor replay` reports them, and each violation event's site."""
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.trace import schema
    from kvdoctor.trace.reader import iter_events

    events = list(iter_events(trace))
    out = [{"kind": f.kind, "count": f.count, "message": f.message, "evidence": f.evidence} for f in analyze(iter(events)).findings]
    for f in out:
        f["violation_sites"] = sorted(
            {e.args.get("site", "") for e in events if e.name == schema.VIOLATION and e.args.get("kind") == f["kind"]}
        )
    return out


def violations(trace: str) -> list[dict]:
    """The trace's violation events in the order they were emitted (on CPU a check before the
    kernel comes before the check of the kernel's output; on a GPU both are read at one poll)."""
    from kvdoctor.trace import schema
    from kvdoctor.trace.reader import iter_events

    keep = ("kind", "count", "site", "bad_index", "requests", "slot_ids")
    return [{k: e.args[k] for k in keep if k in e.args} for e in iter_events(trace) if e.name == schema.VIOLATION]


def judge(case: str, result: dict, fixes: list[str]) -> dict[str, bool]:
    """What each case must show; every value True when it holds."""
    kinds = {f["kind"]: f for f in result["findings"]}
    stale = kinds.get("stale_last_loc", {})
    at_eagle = any("alloc_for_spec_decode" in site for site in stale.get("violation_sites", [])) or "alloc_for_spec_decode" in stale.get(
        "message", ""
    )
    first = result["steps"][0] if result["steps"] else {}
    probe = result.get("probe") or {}
    if case == "oor" and "clamp-last-loc" not in fixes and result.get("kv_write_error"):
        # the unfixed write faulted the device (memcheck lets it run to the device assert): every CUDA
        # call after it fails, the probe's too; the probe must then have turned itself off, once
        failures = probe.get("failures", 0)
        verdict = {"probe_off_after_the_device_fault": failures == 0 or (failures == 1 and not probe.get("ledger_on", True))}
    else:
        verdict = {"probe_no_failures": not probe.get("failures")}
    if case != "oor" or "clamp-last-loc" in fixes:
        verdict["completed"] = bool(result.get("completed"))
    if case == "clean":
        verdict["no_error_finding"] = not [f for f in result["findings"] if f["kind"] not in ("fix_applied", "probe_partial")]
        verdict["no_slot_in_two_rows"] = all(s["slots_in_two_rows"] == 0 for s in result["steps"])
        verdict["sglang_accounts_for_every_slot"] = result["sglang_unaccounted"] == 0
    elif case == "reused-row":
        verdict["stale_last_loc_named_at_the_eagle_site"] = bool(stale) and at_eagle
        verdict["B_took_A_row"] = result["B_takes_A_row"]
        verdict["harm_slots_in_two_rows"] = first.get("slots_in_two_rows", 0) > 0 and "B+C" in first.get("slots_in_two_rows_by", [])
        verdict["harm_verify_writes_into_C"] = first.get("verify_writes_into_another_rows_slots", 0) > 0
    else:  # an out-of-range last_loc is an index_out_of_range (the value itself, before alloc_extend runs)
        verdict["oor_last_loc_named_at_the_eagle_site"] = any(
            v["kind"] == "index_out_of_range" and "alloc_for_spec_decode" in v.get("site", "") for v in result["violations"]
        )
        if "clamp-last-loc" in fixes:
            verdict["clamped"] = kinds.get("fix_applied", {}).get("evidence", {}).get("fix") == "clamp-last-loc"
            verdict["verify_slots_in_range"] = first.get("verify_slots_out_of_range", 1) == 0
        else:
            verdict["verify_slots_out_of_range"] = first.get("verify_slots_out_of_range", 0) > 0
    return verdict


if __name__ == "__main__":
    sys.exit(main())
