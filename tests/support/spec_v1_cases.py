"""EAGLE's first speculative path (`EAGLEWorker`, no overlap scheduler; 0.5.5.post1, 0.5.6.post2 and
0.5.7 run here) at page size 1, 4, 16 or 64 and topk 1 or 2, driven on SGLang's real classes, with
what SGLang's own memory check counts after every request was released (`RESULT {json}`).

    python tests/support/spec_v1_cases.py SPEC [TRACE ...]

SPEC is a JSON list of cases `[page_size, topk]`; with traces, case `i` runs under the probe writing
`TRACE i`. Run in a fresh interpreter with the release under test first on PYTHONPATH.

Each case: five requests of varied prompt lengths and output budgets are prefilled (slots from
`alloc_paged_token_slots_extend`, the tree's `cache_unfinished_req`), then decode until all have
finished, each step as `EAGLEWorker.forward_batch_generation` runs it without the models:
`ScheduleBatch.prepare_for_decode`, `EAGLEWorker._draft_preprocess_decode` (the draft's slots, taken
with `backup_state=True` and given back by `restore_state`), an `EagleVerifyInput` for a chosen
draft tree (topk 1: a chain of 3 steps, 4 draft tokens; topk 2: a 6-token tree of depth 3),
`prepare_for_verify`, target logits that make the greedy verify accept a chosen path (seeded, of
every length from 0 to 3 drafted tokens), `EagleVerifyInput.verify`, then the scheduler's
`process_batch_result_decode` release (`release_kv_cache` in a free group) of the finished requests
and `ScheduleBatch.filter_batch`. Requests finish mid-path (their budget cuts the accepted tokens),
so verify's `has_finished` branch runs too.

SGLang's count: `available_size() + evictable_size() + protected_size()` against the pool's size,
as `Scheduler._check_radix_cache_memory` compares them when idle.

GPU kernels stood in (this machine has no GPU driver), each by a torch function doing what its
source does: the Triton kernels `assign_req_to_token_pool`, `assign_draft_cache_locs`,
`align_evict_mask_to_page_size`, `get_target_cache_loc`, `filter_finished_cache_loc_kernel`,
`alloc_extend_kernel` (the paged allocator's), `copy_all_layer_kv_cache_tiled` (`move_kv_cache`, on
a one-layer KV buffer), and `sgl_kernel`'s `verify_tree_greedy` (`verify_tree_greedy_func` has no
CPU branch). The draft model, the target model and `build_tree_kernel_efficient` are not run: the
tree and the logits are given. `torch.compile` is off (TORCHDYNAMO_DISABLE) so that SGLang's
compiled helpers (`get_src_tgt_cache_loc`, `create_accept_length_filter`) run eagerly. Besides the
kernels: the `EAGLEWorker` is SGLang's class given only the fields `_draft_preprocess_decode` reads
(its `__init__` loads two models), the batch's model config is a namespace of the four fields read,
and vLLM's activation layers, which SGLang imports on a CPU without AMX and this path never calls,
are an import-only module where vLLM is not installed.

Besides SGLang's count, each case reports `unpointed` (the most pages held, between steps, that no
live row up to its length nor the tree points at: 0 unless the path or a stand-in loses a page) and
`beyond_allocated_len` (the most slots the live rows held past the page of their `kv_allocated_len`,
PR#13826's condition).
"""

import inspect
import json
import os
import random
import sys
import warnings
from array import array
from types import SimpleNamespace

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from triton_standins import Launch, assign_req_to_token_pool  # noqa: E402

STEPS = 3
SIZE = 2048
PROMPTS = (13, 16, 21, 30, 7)
BUDGETS = (9, 23, 17, 40, 31)
BONUS = 300
VOCAB = 512
HIDDEN = 8


def tree(topk: int) -> tuple[list[int], list[int], list[list[int]]]:
    """(next_token, next_sibling, paths) of the draft tree, node 0 the verified token; `paths` lists
    each acceptable chain of drafted nodes (the empty one too)."""
    if topk == 1:
        return [1, 2, 3, -1], [-1, -1, -1, -1], [[], [1], [1, 2], [1, 2, 3]]
    # 0 -> {1, 2}; 1 -> {3, 4}; 3 -> {5}
    return [1, 3, -1, 5, -1, -1], [-1, 2, -1, 4, -1, -1], [[], [1], [2], [1, 3], [1, 4], [1, 3, 5]]


# ---- the GPU kernels, in torch ----


def _draft_row(
    pid, table, req_pool_indices, seq_lens, extend_lens, num_new_pages_per_topk, out_cache_loc, pool_len, topk, steps, page_size
):
    """Part 1 of either release's `assign_draft_cache_locs` for program `pid`: its out_cache_loc
    into the request's row. Returns where the row's top-k pages start, the last partial page's
    length and the pages per top-k (None at page size 1 or top-k 1, where there is no more)."""
    if page_size == 1 or topk == 1:
        copy_len, src = topk * steps, pid * topk * steps
    else:
        copy_len, src = int(extend_lens[pid]), int(extend_lens[:pid].sum())
    kv_start = int(seq_lens[pid])
    base = int(req_pool_indices[pid]) * pool_len
    table[base + kv_start : base + kv_start + copy_len] = out_cache_loc[src : src + copy_len].to(table.dtype)
    if page_size == 1 or topk == 1:
        return None
    last_page_len = kv_start % page_size
    return base + kv_start - last_page_len, last_page_len, int(num_new_pages_per_topk[pid])


def _draft_slots_to_front(pid, table, out_cache_loc, layout, topk, steps, page_size):
    """Part 3: each top-k's draft slots, past the duplicated prefix, to the front of out_cache_loc."""
    prefix_base, last_page_len, pages = layout
    for topk_id in range(topk):
        row = prefix_base + topk_id * pages * page_size + last_page_len
        at = pid * topk * steps + topk_id * steps
        out_cache_loc[at : at + steps] = table[row : row + steps].clone().to(out_cache_loc.dtype)


def _draft_rows(
    grid, req_to_token, req_pool_indices, seq_lens, extend_lens, num_new_pages_per_topk, out_cache_loc, pool_len, topk, steps, page_size
):
    """Both releases' program loop: Part 1 for each program, then (where a row has top-k pages)
    yields `(pid, table, layout)` for the release's own Part 2, then Part 3."""
    table = req_to_token.view(-1)
    for pid in range(grid[0]):
        layout = _draft_row(
            pid, table, req_pool_indices, seq_lens, extend_lens, num_new_pages_per_topk, out_cache_loc, pool_len, topk, steps, page_size
        )
        if layout is None:
            continue
        yield pid, table, layout
        _draft_slots_to_front(pid, table, out_cache_loc, layout, topk, steps, page_size)


def assign_draft_cache_locs(
    grid,
    req_pool_indices,
    req_to_token,
    seq_lens,
    extend_lens,
    num_new_pages_per_topk,
    out_cache_loc,
    source_cache_loc,
    target_cache_loc,
    last_page_lens_cumsum,
    duplicate_cache_len,
    pool_len,
    topk,
    speculative_num_steps,
    page_size,
    bs_upper,
    iter_upper,
):
    rows = _draft_rows(
        grid,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        num_new_pages_per_topk,
        out_cache_loc,
        pool_len,
        topk,
        speculative_num_steps,
        page_size,
    )
    for pid, table, (prefix_base, last_page_len, pages) in rows:
        if duplicate_cache_len > 0:
            # Part 2: the last partial page's slots, to copy into each other top-k's first page
            cum = int(last_page_lens_cumsum[pid])
            for topk_id in range(1, topk):
                at = (topk - 1) * (cum - last_page_len) + (topk_id - 1) * last_page_len
                source_cache_loc[at : at + last_page_len] = table[prefix_base : prefix_base + last_page_len]
                tgt = prefix_base + topk_id * pages * page_size
                target_cache_loc[at : at + last_page_len] = table[tgt : tgt + last_page_len]
        # (the kernel's Part 3, in _draft_rows, runs whether or not anything was duplicated)


def assign_draft_cache_locs_0555(
    grid,
    req_pool_indices,
    req_to_token,
    seq_lens,
    extend_lens,
    num_new_pages_per_topk,
    out_cache_loc,
    pool_len,
    topk,
    speculative_num_steps,
    page_size,
    bs_upper,
    iter_upper,
):
    """0.5.5.post1's `assign_draft_cache_locs`: no duplication lists; at top-k > 1 its Part 2 copies the
    last partial page's slot numbers into each top-k's first page of the row."""
    rows = _draft_rows(
        grid,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        num_new_pages_per_topk,
        out_cache_loc,
        pool_len,
        topk,
        speculative_num_steps,
        page_size,
    )
    for _pid, table, (prefix_base, last_page_len, pages) in rows:
        for topk_id in range(topk):
            at = prefix_base + topk_id * pages * page_size
            table[at : at + last_page_len] = table[prefix_base : prefix_base + last_page_len].clone()


def align_evict_mask_to_page_size(grid, seq_lens, evict_mask, page_size, num_draft_tokens, block_size):
    for bid in range(grid[0]):
        seq_len = int(seq_lens[bid])
        row = evict_mask[bid * num_draft_tokens : (bid + 1) * num_draft_tokens]
        num_false = num_draft_tokens - int(row.sum())
        start = (seq_len + num_false - 1) // page_size * page_size - seq_len
        for i in range(max(start, 0), min(start + page_size, num_draft_tokens)):
            row[i] = False


def get_target_cache_loc(
    grid,
    tgt_cache_loc,
    to_free_slots,
    accept_length,
    to_free_num_slots,
    out_cache_loc,
    num_verify_tokens,
    num_verify_tokens_upper,
    bs_upper,
):
    for bid in range(grid[0]):
        tgt_start = int(accept_length[:bid].sum()) + bid
        copy_len = int(accept_length[bid]) + 1
        row = bid * num_verify_tokens
        tgt_cache_loc[tgt_start : tgt_start + copy_len] = out_cache_loc[row : row + copy_len]
        free_now = int(to_free_num_slots[bid])
        free_start = int(to_free_num_slots[:bid].sum())
        at = row + num_verify_tokens - free_now
        to_free_slots[free_start : free_start + free_now] = out_cache_loc[at : at + free_now]


def filter_finished_cache_loc_kernel(
    grid, out_cache_loc, tgt_cache_loc, accept_length, accept_length_filter, bs_upper, num_verify_tokens_upper
):
    for bid in range(grid[0]):
        old_start = int(accept_length[:bid].sum()) + bid
        new_start = int(accept_length_filter[:bid].sum())
        copy_len = int(accept_length_filter[bid])
        out_cache_loc[new_start : new_start + copy_len] = tgt_cache_loc[old_start : old_start + copy_len]


def alloc_extend_kernel(
    grid, pre_lens_ptr, seq_lens_ptr, last_loc_ptr, free_page_ptr, out_indices, bs_upper, page_size, max_num_extend_tokens=None
):
    for pid in range(grid[0]):
        seq_lens, pre_lens = seq_lens_ptr[: pid + 1], pre_lens_ptr[: pid + 1]
        seq_len, pre_len = int(seq_lens_ptr[pid]), int(pre_lens_ptr[pid])
        output_start_loc = int((seq_lens - pre_lens).sum()) - (seq_len - pre_len)
        num_new_pages = (seq_lens + page_size - 1) // page_size - (pre_lens + page_size - 1) // page_size
        self_pages = (seq_len + page_size - 1) // page_size - (pre_len + page_size - 1) // page_size
        new_page_start_loc = int(num_new_pages.sum()) - self_pages
        last_loc = int(last_loc_ptr[pid])
        num_part1 = min(seq_len, (pre_len + page_size - 1) // page_size * page_size) - pre_len
        for i in range(num_part1):
            out_indices[output_start_loc + i] = last_loc + 1 + i
        if pre_len + num_part1 == seq_len:
            continue
        num_part2 = seq_len // page_size * page_size - (pre_len + page_size - 1) // page_size * page_size
        for i in range(num_part2):
            page = int(free_page_ptr[new_page_start_loc + i // page_size])
            out_indices[output_start_loc + num_part1 + i] = page * page_size + i % page_size
        if pre_len + num_part1 + num_part2 == seq_len:
            continue
        num_part3 = seq_len - seq_len // page_size * page_size
        start_loc = int(free_page_ptr[new_page_start_loc + self_pages - 1])
        for i in range(num_part3):
            out_indices[output_start_loc + num_part1 + num_part2 + i] = start_loc * page_size + i


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, target_predict, topk=-1, **tree):
    """`sgl_kernel.verify_tree_greedy` (VerifyTreeGreedy, one block per request), in torch."""
    # the tree arrays are `retrive_*` up to 0.5.10, `retrieve_*` from 0.5.11
    retrive_index, retrive_next_token, retrive_next_sibling = (
        tree.get(f"retrive_{n}", tree.get(f"retrieve_{n}")) for n in ("index", "next_token", "next_sibling")
    )
    bs, num_draft_tokens = candidates.shape
    num_speculative_tokens = accept_index.shape[1]
    flat_target = target_predict.reshape(-1)
    for bx in range(bs):
        last = int(retrive_index[bx, 0])
        accept_index[bx, 0] = last
        accepted = 0
        cur = 0
        for _ in range(1, num_speculative_tokens):
            cur = int(retrive_next_token[bx, cur])
            while cur != -1:
                draft_index = int(retrive_index[bx, cur])
                if int(candidates[bx, cur]) == int(flat_target[last]):
                    predicts[last] = flat_target[last]
                    accepted += 1
                    accept_index[bx, accepted] = draft_index
                    last = draft_index
                    break
                cur = int(retrive_next_sibling[bx, cur])
            if cur == -1:
                break
        accept_token_num[bx] = accepted
        predicts[last] = flat_target[last]
    return predicts, accept_index, accept_token_num


class KvBuffer:
    """The allocator's KV pool for this run: one layer's K and V rows; `move_kv_cache` does what the
    Triton `copy_all_layer_kv_cache_tiled` does on every layer."""

    def __init__(self, size: int, page_size: int):
        self.k = torch.zeros((size + page_size, 2), dtype=torch.float16)
        self.v = torch.zeros((size + page_size, 2), dtype=torch.float16)

    def move_kv_cache(self, tgt_loc, src_loc):
        if tgt_loc.numel():
            self.k[tgt_loc.long()] = self.k[src_loc.long()]
            self.v[tgt_loc.long()] = self.v[src_loc.long()]


def import_only_vllm():
    """`sglang.srt.layers.activation` (imported through `eagle_info_v2` -> `model_runner`) imports
    vLLM's activation layers on a CPU without AMX; nothing here calls them. An import-only module
    stands in where vLLM is not installed (any use raises)."""
    import importlib.util
    import types

    if importlib.util.find_spec("vllm") is not None:
        return

    class Unavailable:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("vLLM is not installed here")

    names = ["vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.activation"]
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[names[-1]].GeluAndMul = sys.modules[names[-1]].SiluAndMul = Unavailable


def stand_in_kernels():
    import_only_vllm()
    from sglang.srt.mem_cache import allocator
    from sglang.srt.speculative import eagle_info, eagle_worker, spec_utils

    spec_utils.assign_req_to_token_pool = Launch(assign_req_to_token_pool)
    if "duplicate_cache_len" in eagle_worker.assign_draft_cache_locs.arg_names:
        eagle_worker.assign_draft_cache_locs = Launch(assign_draft_cache_locs)
    else:
        eagle_worker.assign_draft_cache_locs = Launch(assign_draft_cache_locs_0555)
    # 0.5.5.post1's `assign_req_to_token_pool_func` launches its kernel only where `_is_cuda` or
    # `_is_hip` (no CPU branch): launched as on a GPU
    spec_utils._is_cuda = True
    eagle_info.align_evict_mask_to_page_size = Launch(align_evict_mask_to_page_size)
    eagle_info.get_target_cache_loc = Launch(get_target_cache_loc)
    eagle_info.filter_finished_cache_loc_kernel = Launch(filter_finished_cache_loc_kernel)
    eagle_info.verify_tree_greedy_func = verify_tree_greedy
    allocator.alloc_extend_kernel = Launch(alloc_extend_kernel)


# ---- one case ----


def ceil(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def run_case(page_size: int, topk: int, seed: int) -> dict:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache import common
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput
    from sglang.srt.speculative.eagle_worker import EAGLEWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    next_token, next_sibling, paths = tree(topk)
    draft_tokens = len(next_token)
    set_global_server_args_for_scheduler(
        ServerArgs(
            model_path="dummy",
            device="cpu",
            attention_backend="torch_native",
            page_size=page_size,
            speculative_algorithm="EAGLE",
            speculative_num_steps=STEPS,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=draft_tokens,
        )
    )
    kv = KvBuffer(SIZE, page_size)
    req_pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(SIZE, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False)
    else:
        allocator = PagedTokenToKVPoolAllocator(SIZE, page_size, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False)
    fields = dict(disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=page_size, is_eagle=True)
    try:  # 0.5.6 and on: one CacheInitParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        tree_cache = RadixCache(CacheInitParams(**fields))
    except ImportError:
        tree_cache = RadixCache(**fields)
    worker = EAGLEWorker.__new__(EAGLEWorker)  # the fields `_draft_preprocess_decode` reads, as __init__ sets them
    worker.page_size, worker.topk, worker.speculative_num_steps, worker.device = page_size, topk, STEPS, "cpu"
    worker.token_to_kv_pool_allocator = allocator
    worker._model_runner = SimpleNamespace(token_to_kv_pool=kv)  # the draft model runner: its KV pool only
    worker.num_new_pages_per_topk = torch.empty((), dtype=torch.int64)
    worker.extend_lens = torch.empty((), dtype=torch.int64)

    draws = random.Random(seed)
    reqs = []
    for n, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS, strict=True)):
        req = Req(
            f"spec-{page_size}-{topk}-{n}",
            "",
            array("q", range(20 + 37 * n, 20 + 37 * n + prompt)).tolist(),
            SamplingParams(max_new_tokens=budget, temperature=0),
            vocab_size=VOCAB,
        )
        req.sampling_params.normalize(None)
        reqs.append(req)
    if "reqs" in inspect.signature(req_pool.alloc).parameters:  # 0.5.9 and on: the pool sets req_pool_idx
        req_pool.alloc(reqs)
    else:
        for req, row in zip(reqs, req_pool.alloc(len(reqs)), strict=True):
            req.req_pool_idx = row
    for req in reqs:  # prefill, as prepare_for_extend and process_batch_result_prefill do it
        req.init_next_round_input(tree_cache)
        n = len(req.fill_ids)
        zero = torch.zeros(1, dtype=torch.int64)
        slots = (
            common.alloc_paged_token_slots_extend(tree_cache, zero, zero, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)
            if page_size > 1
            else common.alloc_token_slots(tree_cache, n)
        )
        req_pool.write((req.req_pool_idx, slice(0, n)), slots.to(torch.int32))
        req.kv_committed_len = req.kv_allocated_len = n
        req.output_ids.append(BONUS)
        tree_cache.cache_unfinished_req(req)

    model_config = SimpleNamespace(
        hidden_size=HIDDEN, dtype=torch.float16, is_encoder_decoder=False, vocab_size=VOCAB, think_end_id=None, spec_hidden_size=HIDDEN
    )
    batch = ScheduleBatch(
        reqs=reqs,
        req_to_token_pool=req_pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=tree_cache,
        device="cpu",
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        model_config=model_config,
    )
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, vocab_size=VOCAB)
    batch.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    batch.seq_lens = torch.tensor([len(r.origin_input_ids) for r in reqs], dtype=torch.int64)
    batch.seq_lens_cpu = batch.seq_lens.clone()
    batch.orig_seq_lens = batch.seq_lens.to(torch.int32)
    batch.seq_lens_sum = int(batch.seq_lens.sum())
    batch.output_ids = torch.full((len(reqs),), BONUS, dtype=torch.int64)
    batch.spec_info = EagleDraftInput(
        verified_id=torch.full((len(reqs),), BONUS, dtype=torch.int32),
        hidden_states=torch.zeros((len(reqs), HIDDEN)),
        topk_p=torch.ones((len(reqs), topk)),
        topk_index=torch.zeros((len(reqs), topk), dtype=torch.int64),
        capture_hidden_mode=CaptureHiddenMode.LAST,
    )

    tree_prefix = "retrieve_" if "retrieve_index" in EagleVerifyInput.__dataclass_fields__ else "retrive_"
    accepted_lengths: list[int] = []
    steps = finished_mid_path = unpointed = beyond_allocated_len = 0
    while batch.reqs:
        steps += 1
        bs = len(batch.reqs)
        batch.prepare_for_decode()
        worker._draft_preprocess_decode(batch)  # the draft's slots, given back after the draft forward
        chosen = [draws.choice(paths) for _ in range(bs)]
        candidates = torch.tensor([[10 + i for i in range(draft_tokens)] for _ in range(bs)], dtype=torch.int64)
        candidates[:, 0] = BONUS
        target = torch.full((bs, draft_tokens), 400, dtype=torch.int64)
        for b, path in enumerate(chosen):
            at = 0
            for node in path:
                target[b, at] = 10 + node
                at = node
            target[b, at] = BONUS
        verify = EagleVerifyInput(
            draft_token=candidates.reshape(-1),
            custom_mask=torch.ones(1, dtype=torch.bool),
            positions=torch.zeros(bs * draft_tokens, dtype=torch.int64),
            **{
                f"{tree_prefix}index": torch.arange(bs * draft_tokens, dtype=torch.int64).reshape(bs, draft_tokens),
                f"{tree_prefix}next_token": torch.tensor([next_token] * bs, dtype=torch.int64),
                f"{tree_prefix}next_sibling": torch.tensor([next_sibling] * bs, dtype=torch.int64),
                f"{tree_prefix}cum_len": None,
            },
            spec_steps=STEPS,
            topk=topk,
            draft_token_num=draft_tokens,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            seq_lens_sum=int(batch.seq_lens.sum()),
            seq_lens_cpu=batch.seq_lens_cpu.clone(),
        )
        # EAGLEWorker.verify without the target forward
        verify.prepare_for_verify(batch, page_size)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.spec_info = verify
        logits = torch.zeros((bs * draft_tokens, VOCAB))
        logits[torch.arange(bs * draft_tokens), target.reshape(-1)] = 1.0
        out = LogitsProcessorOutput(next_token_logits=logits, hidden_states=torch.zeros((bs * draft_tokens, HIDDEN)))
        verify.hidden_states = out.hidden_states
        before = [len(r.output_ids) for r in batch.reqs]
        res = verify.verify(batch, out, allocator, page_size)
        batch.forward_mode = ForwardMode.DECODE
        batch.spec_info = res.draft_input
        for r, n, path in zip(batch.reqs, before, chosen, strict=True):
            accepted_lengths.append(len(r.output_ids) - n - 1)
            finished_mid_path += r.finished() and len(r.output_ids) - n < len(path) + 1
        # the draft extend's output (capture_for_decode), for the next draft
        draft = batch.spec_info
        accepted_cpu = draft.accept_length_cpu if hasattr(draft, "accept_length_cpu") else draft.num_accepted_drafts_cpu
        rows = len(accepted_cpu)  # one row per request still decoding
        draft.verified_id = torch.full((rows,), BONUS, dtype=torch.int32)
        draft.topk_p, draft.topk_index = torch.ones((rows, topk)), torch.zeros((rows, topk), dtype=torch.int64)
        draft.hidden_states = torch.zeros((rows, HIDDEN))
        # process_batch_result_decode: the finished requests' release
        allocator.free_group_begin()
        for r in batch.reqs:
            if r.finished():
                common.release_kv_cache(r, tree_cache)
        allocator.free_group_end()
        # the scheduler's update_running_batch (0.5.7 and on say the draft input was filtered in verify)
        if "v1_spec_info_filtered" in inspect.signature(batch.filter_batch).parameters:
            batch.filter_batch(v1_spec_info_filtered=True)
        else:
            batch.filter_batch()
        if batch.reqs:
            batch.output_ids = torch.full((len(batch.reqs),), BONUS, dtype=torch.int64)
        # between steps: every held page is one a live row (up to its length) or the tree points into,
        # and what the live rows hold past the page of their `kv_allocated_len`
        # (filter_batch leaves an emptied batch's tensors as they were)
        live = list(zip(batch.reqs, batch.seq_lens.tolist(), strict=True)) if batch.reqs else []
        rows = [req_pool.req_to_token[r.req_pool_idx, :n].long() for r, n in live]
        if tree_cache.root_node.children:
            rows.append(tree_cache.all_values_flatten().long())
        pointed = len(set((torch.cat(rows) // page_size).tolist())) * page_size if rows else 0
        held = SIZE - int(allocator.available_size())
        unpointed = max(unpointed, held - pointed)
        beyond = sum(ceil(n, page_size) - ceil(r.kv_allocated_len, page_size) for r, n in live)
        beyond_allocated_len = max(beyond_allocated_len, beyond)

    available, evictable, protected = int(allocator.available_size()), int(tree_cache.evictable_size()), int(tree_cache.protected_size())
    return {
        "page_size": page_size,
        "topk": topk,
        "steps": steps,
        "accepted": sorted(set(accepted_lengths)),
        "finished_mid_path": finished_mid_path,
        "outputs": [len(r.output_ids) for r in reqs],
        "unpointed": unpointed,
        "beyond_allocated_len": beyond_allocated_len,
        "available": available,
        "evictable": evictable,
        "protected": protected,
        "sglang_unaccounted": SIZE - available - evictable - protected,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    traces = sys.argv[2:]
    stand_in_kernels()
    from kvdoctor.probe.core import runtime

    out = []
    for i, (page_size, topk) in enumerate(spec):
        if traces:
            runtime.activate(traces[i])
        try:
            out.append(run_case(page_size, topk, seed=page_size * 10 + topk))
        finally:
            if traces:
                runtime.deactivate()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
