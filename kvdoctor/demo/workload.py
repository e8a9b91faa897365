"""A multi-turn chat workload driven through SGLang's real allocator, radix tree and request pool.

It does what the scheduler does for each request, with SGLang's own classes: match the prefix in
the `RadixCache`, lock it, take a request row from `ReqToTokenPool`, allocate KV slots (evicting
from the tree when the pool runs short), write the request's row, decode token by token, then
insert the sequence into the tree, free the duplicates and the partial last page, unlock and free
the row. Faults can be planted, each the way it happens in a real server, and the workload
reports the exact number of slots each planted fault affects, computed from the real indices.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from kvdoctor.demo.engine import Engine, Request

__all__ = ["FAULTS", "Engine", "Request", "WorkloadConfig", "WorkloadResult", "run_workload"]

FAULTS = (
    "none",
    "leak",
    "double-free",
    "stale-last-loc",
    "relocate",
    "index-out-of-range",
    "double-alloc",
    "tree-unseen",
    "row-leak",
    "double-free-in-call",
)


@dataclasses.dataclass
class WorkloadConfig:
    conversations: int = 24
    turns: int = 4
    batch: int = 4
    user_tokens: int = 48
    output_tokens: int = 16
    pool_tokens: int = 2048
    page_size: int = 1
    fault: str = "none"
    fault_at_request: int = 9
    tree: str = "radix"
    seed: int = 0
    vocab: int = 500
    token_base: int = 0

    @property
    def victim(self) -> int:
        """The request the fault is planted in: the last one for tree-unseen (what the tree took
        unseen is still there at the exit census), else `fault_at_request`."""
        return self.conversations * self.turns - 1 if self.fault == "tree-unseen" else self.fault_at_request


@dataclasses.dataclass
class WorkloadResult:
    requests: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    planted: dict[str, int | str | list[int]] = dataclasses.field(
        default_factory=dict
    )  # counts, by finding kind (a left row's rid, slot ids)
    sglang_check: dict[str, int] = dataclasses.field(default_factory=dict)
    outputs_digest: int = 0


class _Live:
    def __init__(self, req: Request, tokens: list[int], prefix: Any, node: Any) -> None:
        self.req = req
        self.tokens = tokens
        self.prefix_len = int(len(prefix))
        self.node = node
        self.seq_len = 0
        self.lock: Any = None  # the tree lock taken on its prefix
        self.number = 0  # its place in the run (the planted fault picks one)


def run_workload(config: WorkloadConfig, engine: Engine | None = None) -> WorkloadResult:
    torch_mod = __import__("torch")
    engine = engine or Engine(config.pool_tokens, config.page_size, tree=config.tree)
    rng = random.Random(config.seed)
    result = WorkloadResult()
    system_prompt = [config.token_base + rng.randrange(config.vocab) for _ in range(64)]
    histories = [list(system_prompt) for _ in range(config.conversations)]
    order = [(turn, conv) for turn in range(config.turns) for conv in range(config.conversations)]
    request_no = 0
    for start in range(0, len(order), config.batch):
        batch = []
        for _turn, conv in order[start : start + config.batch]:
            histories[conv] = histories[conv] + [config.token_base + rng.randrange(config.vocab) for _ in range(config.user_tokens)]
            batch.append((conv, list(histories[conv])))
        live: list[_Live] = []
        for conv, tokens in batch:
            prefix, node = engine.match(tokens)
            lock = engine.lock(node)
            req = Request(f"conv{conv}-req{request_no}")
            request_no += 1
            engine.take_row(req)
            item = _Live(req, tokens, prefix, node)
            item.lock = lock
            item.number = request_no - 1
            _prefill(engine, item, prefix, result)
            live.append(item)
        for step in range(config.output_tokens):
            for item in live:
                fault_here = item.number == config.victim and step >= config.output_tokens // 2 and not result.planted
                token = _decode(engine, item, result, config, rng, fault_here)
                item.tokens.append(token)
        for item in live:
            conv = int(item.req.rid.split("-")[0][4:])
            histories[conv] = list(item.tokens)
            _finish(engine, item, result, config, item.number == config.victim)
            result.outputs_digest = (result.outputs_digest * 31 + sum(item.tokens)) % (1 << 61)
        result.requests = request_no
    result.sglang_check = engine.sglang_leak_check()
    del torch_mod
    return result


def _make_room(engine: Engine, need: int, result: WorkloadResult) -> None:
    if engine.allocator.available_size() < need:
        result.evictions += 1
        result.evicted_tokens += engine.evict(need - engine.allocator.available_size() + engine.page_size)


def _row(engine: Engine, item: _Live) -> Any:
    return engine.req_pool.req_to_token[item.req.req_pool_idx]


def _prefill(engine: Engine, item: _Live, prefix: Any, result: WorkloadResult) -> None:
    torch = engine.torch
    ps = engine.page_size
    idx = item.req.req_pool_idx
    seq_len = len(item.tokens)
    extend = seq_len - item.prefix_len
    if item.prefix_len:
        engine.req_pool.write((idx, slice(0, item.prefix_len)), prefix.to(torch.int32))
    _make_room(engine, extend + ps, result)
    if ps == 1:
        out = engine.allocator.alloc(extend)
    else:
        prefix_lens = torch.tensor([item.prefix_len], dtype=torch.int64)
        seq_lens = torch.tensor([seq_len], dtype=torch.int64)
        last_loc = engine.get_last_loc(engine.req_pool.req_to_token, torch.tensor([idx], dtype=torch.int64), prefix_lens)
        out = engine.allocator.alloc_extend(prefix_lens, prefix_lens.clone(), seq_lens, seq_lens.clone(), last_loc, extend)
    if out is None:
        raise RuntimeError("KV pool exhausted; raise pool_tokens")
    engine.req_pool.write((idx, slice(item.prefix_len, seq_len)), out.to(torch.int32))
    item.seq_len = seq_len
    item.req.kv.kv_allocated_len = seq_len


def _decode(engine: Engine, item: _Live, result: WorkloadResult, config: WorkloadConfig, rng: random.Random, fault_here: bool) -> int:
    torch = engine.torch
    ps = engine.page_size
    idx = item.req.req_pool_idx
    _make_room(engine, ps, result)
    if ps == 1:
        out = engine.allocator.alloc(1)
        if fault_here and config.fault == "index-out-of-range":
            # A slot index one past the KV buffer (size + page_size rows) reaches the pool.
            bad = torch.tensor([engine.allocator.size + ps], dtype=torch.int64)
            engine.allocator.free(bad)
            result.planted["index_out_of_range"] = 1
    else:
        seq_lens = torch.tensor([item.seq_len + 1], dtype=torch.int64)
        last_loc = engine.get_last_loc(
            engine.req_pool.req_to_token, torch.tensor([idx], dtype=torch.int64), torch.tensor([item.seq_len], dtype=torch.int64)
        )
        if fault_here and config.fault == "stale-last-loc":
            # The request's last page is released (retracted / relocated) after last_loc was
            # read and before it is used: the seed-002 shape.
            last_page_start = int(last_loc[0]) // ps * ps
            engine.allocator.free(torch.arange(last_page_start, last_page_start + ps, dtype=torch.int64))
            result.planted["stale_last_loc"] = 1
        if fault_here and config.fault == "relocate" and item.seq_len % ps:
            # The request's last page moves (as a HiCache load or a defragmenting copy does) after
            # last_loc was read: its row now points at the new page, last_loc at the freed old one.
            start = item.seq_len // ps * ps
            old_page = engine.req_pool.req_to_token[idx, start : item.seq_len].to(torch.int64)
            new_page = engine.allocator.alloc(ps)
            engine.req_pool.write((idx, slice(start, item.seq_len)), new_page[: item.seq_len - start].to(torch.int32))
            engine.allocator.free(torch.arange(int(old_page[0]) // ps * ps, int(old_page[0]) // ps * ps + ps, dtype=torch.int64))
            result.planted["stale_last_loc"] = 1
        if fault_here and config.fault == "index-out-of-range":
            # The proposed `last_loc.clamp(0, total_slots)` lets one-past-the-end through.
            last_loc = torch.full_like(last_loc, engine.allocator.size + ps)
            result.planted["index_out_of_range"] = 1
        out = engine.allocator.alloc_decode(seq_lens, seq_lens.clone(), last_loc)
    if out is None:
        raise RuntimeError("KV pool exhausted; raise pool_tokens")
    engine.req_pool.write((idx, slice(item.seq_len, item.seq_len + 1)), out.to(torch.int32))
    item.seq_len += 1
    item.req.kv.kv_allocated_len = item.seq_len
    return config.token_base + rng.randrange(config.vocab)


def _finish(engine: Engine, item: _Live, result: WorkloadResult, config: WorkloadConfig, victim: bool) -> None:
    """What `cache_finished_req` does: insert, free duplicates and the partial page, unlock."""
    torch = engine.torch
    ps = engine.page_size
    kv = _row(engine, item)[: item.seq_len].to(torch.int64).clone()
    aligned = item.seq_len // ps * ps
    fault = config.fault if victim else "none"
    if fault == "leak":
        # The request is finished without returning its own slots or inserting them: the
        # "memory leak detected ... diff=N" of the seeds.
        own = kv[item.prefix_len :]
        pages = torch.unique(own // ps)
        result.planted["orphan_slots"] = int(pages.numel()) * ps
    elif fault == "double-free":
        own = kv[item.prefix_len :]
        engine.allocator.free(own)
        engine.allocator.free(own)
        result.planted["double_free"] = int(own.numel())
    elif fault == "double-free-in-call":
        # Its own slots given back in one call naming its last two slots twice (sglang#13483's
        # shape, on the device pool). One-slot pages: two slots on the free list twice. Larger
        # pages: SGLang's paged free keeps each page once, and nothing is wrong.
        own = kv[item.prefix_len :]
        engine.allocator.free(torch.cat([own, own[-2:]]))
        result.planted["double_free"] = 2 if ps == 1 else 0
        result.planted["slot_ids"] = sorted(int(x) for x in own[-2:]) if ps == 1 else []
    else:
        if fault == "tree-unseen":
            new_prefix = engine.insert_unseen(item.tokens[:aligned], kv[:aligned])
            result.planted["tree_unseen_slots"] = max(aligned - max(new_prefix, item.prefix_len), 0)
        else:
            new_prefix = engine.insert(item.tokens[:aligned], kv[:aligned], item.prefix_len)
        if new_prefix > item.prefix_len:
            engine.allocator.free(kv[item.prefix_len : new_prefix])
        if aligned < item.seq_len:
            engine.allocator.free(kv[aligned:])
        if fault == "double-alloc":
            # A tree node's slots are released while the node stays in the tree; the next
            # allocations hand them out again while the tree still serves them as a prefix.
            prefix, _node = engine.match(item.tokens[:aligned])
            victim_slots = prefix[-ps * 2 :] if len(prefix) >= 2 * ps else prefix
            engine.allocator.free(victim_slots)
            result.planted["double_alloc_candidates"] = int(victim_slots.numel())
    engine.unlock(item.lock)
    if fault == "row-leak":
        # Its slots go back as a finished request's do, its row never: the request pool has one
        # row fewer ("req_to_token_pool memory leak detected!" in SGLang's idle check).
        result.planted["request_rows_leaked"] = 1
        result.planted["row"] = int(item.req.kv.req_pool_idx or 0)
        result.planted["rid"] = item.req.rid
        return
    engine.release_row(item.req)
