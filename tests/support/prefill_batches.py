"""SGLang's own prefill path over its real request pool, allocator and radix tree, as its scheduler
drives them: requests admitted whole (their prefix matched in the tree and locked, as `PrefillAdder`
leaves them), the batch fields `ScheduleBatch.prepare_for_extend` sets, then its allocation
`alloc_for_extend` -> `write_cache_indices`, and `release_kv_cache` at the end. 0.5.23's layout
(mem_cache/allocation.py, the row in `req.kv`) and 0.5.9's (mem_cache/common.py, as 0.5.3.post2 -
0.5.15 have it) are both spoken. Used by tests/integration/test_prefill_rows.py and
tests/gpu/harness/prefill_rows.py; import it after the probe is active, so that SGLang's modules are hooked.
"""

from __future__ import annotations

import ctypes
import importlib.util
from array import array
from typing import Any

import numpy as np
import torch

# second-0 and second-1 begin with 32 and 38 tokens of first-0's and first-1's (whole pages at 16);
# second-2 shares nothing
FIRST = [list(range(100 + 50 * n, 135 + 53 * n)) for n in range(3)]
SECOND = [list(range(100, 132)) + list(range(900, 919)), list(range(150, 198)) + list(range(700, 705)), list(range(2000, 2029))]


class WriteReqToTokenPoolStandIn:
    """SGLang's Triton kernel `write_req_to_token_pool_triton`, launched as `kernel[(batch_size,)](...)`,
    in torch, for a machine with no GPU driver: program `pid` loads `pre_lens[pid]` int64 values from
    the address `prefix_pointers[pid]` (the host passes the prefix tensors' data pointers) into
    `req_to_token[req_pool_indices[pid], :pre_len]`, then copies `out_cache_loc[cumsum_start :
    cumsum_start + seq_len - pre_len]` after them, `cumsum_start` being the sum of `extend_lens`
    over the programs before it."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(req_to_token, req_pool_indices, prefix_pointers, pre_lens, seq_lens, extend_lens, out_cache_loc, stride):
            self.launches += 1
            table, cumsum_start = req_to_token.view(-1), 0
            for pid in range(grid[0]):
                row, pre_len, seq_len = int(req_pool_indices[pid]), int(pre_lens[pid]), int(seq_lens[pid])
                if pre_len:
                    loaded = (ctypes.c_int64 * pre_len).from_address(int(prefix_pointers[pid]))
                    table[row * stride : row * stride + pre_len] = torch.tensor(list(loaded), dtype=table.dtype)
                n = seq_len - pre_len
                table[row * stride + pre_len : row * stride + seq_len] = out_cache_loc[cumsum_start : cumsum_start + n].to(table.dtype)
                cumsum_start += int(extend_lens[pid])

        return launch


class PrefillBatches:
    """The installed SGLang's pools on `device`, and its prefill and release of whole requests."""

    def __init__(self, page_size: int, device: str, attention_backend: str, size: int = 4096) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.server_args import ServerArgs

        self.page_size, self.device, self.size = page_size, device, size
        self.layout = "0.5.23" if importlib.util.find_spec("sglang.srt.mem_cache.allocation") else "0.5.9"
        if self.layout == "0.5.23":
            from sglang.srt.mem_cache import allocation as writer
            from sglang.srt.mem_cache import common
            from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
            from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
            from sglang.srt.runtime_context import get_context, get_parallel

            get_context().set_server_args(
                ServerArgs(model_path="unused", device=device, attention_backend=attention_backend, page_size=page_size)
            )
            # one process, no decode context parallelism: what a one-GPU scheduler publishes (on CUDA,
            # alloc_for_extend reads it; nothing is published here)
            get_parallel().override_permanently(dcp_enabled=False)
            self.release = lambda req, tree: common.release_kv_cache(req, tree, checkpoint=True)
        else:
            from sglang.srt.mem_cache import common as writer
            from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
            from sglang.srt.server_args import set_global_server_args_for_scheduler

            # "dummy": 0.5.9's ServerArgs reads the model's config at construction otherwise
            set_global_server_args_for_scheduler(
                ServerArgs(model_path="dummy", device=device, attention_backend=attention_backend, page_size=page_size)
            )
            self.release = writer.release_kv_cache
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.sampling.sampling_params import SamplingParams

        self.writer, self.req_cls, self.batch_cls, self.params_cls = writer, Req, ScheduleBatch, SamplingParams
        self.req_pool = ReqToTokenPool(size=16, max_context_len=512, device=device, enable_memory_saver=False)
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(size, dtype=torch.float16, device=device, kvcache=None, need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype=torch.float16, device=device, kvcache=None, need_sort=False)
        self.tree = RadixCache(
            CacheInitParams(disable=False, req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.allocator, page_size=page_size)
        )

    def stand_in_for_the_kernel(self) -> WriteReqToTokenPoolStandIn:
        """The Triton branch on a machine without a GPU driver: `support_triton` says yes and the
        kernel object, only it, is the torch stand-in."""
        stand_in = WriteReqToTokenPoolStandIn()
        self.writer.support_triton = lambda backend: True
        self.writer.write_req_to_token_pool_triton = stand_in
        return stand_in

    def admitted(self, rid: str, ids: list[int]) -> Any:
        if self.layout == "0.5.23":
            req = self.req_cls(rid, "", array("q", ids), self.params_cls(max_new_tokens=16))
            req.sampling_params.normalize(None)
            req.init_next_round_input(self.tree)
            req.extend_end = len(req.full_untruncated_fill_ids)
            req.lock = self.tree.lock(req.last_node)
        else:
            req = self.req_cls(rid, "", list(ids), self.params_cls(max_new_tokens=16))
            req.sampling_params.normalize(None)
            req.init_next_round_input(self.tree)
            req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)
            self.tree.inc_lock_ref(req.last_node)
        return req

    def row_prefix_seq(self, req: Any) -> tuple[int, int, int]:
        if self.layout == "0.5.23":
            return req.kv.req_pool_idx, req.prefix_len, req.extend_end
        return req.req_pool_idx, len(req.prefix_indices), len(req.fill_ids)

    def prefill(self, reqs: list[Any]) -> None:
        """`prepare_for_extend`'s batch fields, then its allocation (alloc_for_extend -> write_cache_indices)."""
        batch = self.batch_cls(
            reqs=reqs, req_to_token_pool=self.req_pool, token_to_kv_pool_allocator=self.allocator, tree_cache=self.tree, device=self.device
        )
        lens = [self.row_prefix_seq(r) for r in reqs]
        seq_lens = [seq for _, _, seq in lens]
        batch.prefix_lens = [prefix for _, prefix, _ in lens]
        batch.extend_lens = [seq - prefix for _, prefix, seq in lens]
        batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int64).to(self.device)
        batch.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        batch.extend_num_tokens = sum(batch.extend_lens)
        self.writer.alloc_for_extend(batch)

    def finish(self, reqs: list[Any]) -> None:
        for req in reqs:
            if self.layout != "0.5.23":
                req.kv_committed_len = req.kv_allocated_len = len(req.fill_ids)
            req.output_ids.append(7)
            req.finished_reason = "stop"
            self.release(req, self.tree)

    def run_two_batches(self) -> list[Any]:
        """A first batch prefilled and finished into the tree, then a second sharing its prefixes,
        prefilled and left live; returns the second batch's requests."""
        first = [self.admitted(f"first-{n}", ids) for n, ids in enumerate(FIRST)]
        self.prefill(first)
        self.finish(first)
        second = [self.admitted(f"second-{n}", ids) for n, ids in enumerate(SECOND)]
        self.prefill(second)
        return second

    def unaccounted(self) -> int:
        """SGLang's own idle check: slots neither free nor the tree's."""
        return self.size - int(self.allocator.available_size()) - int(self.tree.evictable_size()) - int(self.tree.protected_size())


def ownership(ledger: Any, batches: PrefillBatches, live: list[Any]) -> dict[str, Any]:
    """The ledger's owners against what the live requests' rows hold: past its prefix a row's slots
    are owned by that row, and no other slot is owned; the prefix slots are the tree's."""
    from kvdoctor.probe.base.vocabulary import OWNED, TREE

    with ledger.lock:
        state, owner = (np.asarray(ledger.xp.to_host(a)) for a in (ledger.state, ledger.owner))
    rows = [batches.row_prefix_seq(req) for req in live]
    table = batches.req_pool.req_to_token.cpu()
    expected, prefix_not_tree = {}, 0
    for row, prefix_len, seq_len in rows:
        for column, slot in enumerate(table[row, :seq_len].tolist()):
            page = slot // batches.page_size
            if column < prefix_len:
                prefix_not_tree += int(state[page] != TREE)
            else:
                expected[page] = row
    owned = {int(p): int(owner[p]) for p in np.nonzero(state == OWNED)[0]}
    return {
        "prefix_lens": [prefix for _, prefix, _ in rows],
        "seq_lens": [seq for _, _, seq in rows],
        "owner_mismatches": sum(owned.get(p) != r for p, r in expected.items()) + len(set(owned) - set(expected)),
        "owned_pages": len(owned),
        "expected_owned_pages": len(expected),
        "prefix_not_tree": prefix_not_tree,
    }


def live_censuses(state: Any, since: float, live_requests: int, wanted: int = 3, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The rolling censuses taken after `since` with `live_requests` requests live (counted in the
    probe's own state, not by time), up to `wanted` of them."""
    import time

    found: dict[float, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(found) < wanted:
        for rolling in list(state.rolling.values()):
            census, taken = rolling.last, rolling.last_s
            if census is not None and taken > since and census["live_requests"] == live_requests:
                found[taken] = census
        time.sleep(0.05)
    return [{k: c[k] for k in ("orphan_slots", "owned_slots", "live_requests")} for c in found.values()]
