"""The quiet census of a hybrid request pool's Mamba slots (`mamba_slots.py`): what it holds to
SGLang's own counts before naming, the two-census rule, and what turns it off. The real server's
cases (a clean LFM2 load, a dropped `free_mamba_cache` named exactly): tests/e2e/test_hybrid_server.py."""

from __future__ import annotations

import types

import torch

from kvdoctor.probe.engines.sglang.mamba_slots import MambaSlots
from kvdoctor.trace import schema


class MambaSlotAllocator:
    """The two attributes and the count a census reads of SGLang's allocator of that name."""

    def __init__(self, size: int, free: list[int]) -> None:
        self.size = size
        self.free_slots = torch.tensor(free, dtype=torch.int64)
        self._alloc_iter = None

    def available_size(self) -> int:
        return len(self.free_slots)


class Tree:
    def __init__(self, values: list[int], counted: int | None = None, sessions: dict | None = None) -> None:
        self.values = values
        self.counted = len(values) if counted is None else counted
        self.sessions = sessions or {}

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return torch.tensor(self.values, dtype=torch.int64)

    def mamba_evictable_size(self) -> int:
        return self.counted

    def mamba_protected_size(self) -> int:
        return 0

    def session_records(self) -> dict:
        return self.sessions


class Emitter:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def emit(self, name: str, args: dict) -> None:
        self.events.append((name, args))


def probe() -> types.SimpleNamespace:
    return types.SimpleNamespace(emitter=Emitter(), sites=types.SimpleNamespace(name=lambda site: f"site {site}"), states={})


def pool(size: int, free: list[int]) -> types.SimpleNamespace:
    return types.SimpleNamespace(mamba_allocator=MambaSlotAllocator(size, free), enable_mamba_extra_buffer=False, mamba_ckpt_pool=None)


def named(p: types.SimpleNamespace) -> list[dict]:
    return [args for name, args in p.emitter.events if name == schema.VIOLATION]


def status(p: types.SimpleNamespace) -> list[dict]:
    return [args for name, args in p.emitter.events if name == schema.PROBE_STATUS]


def taken(slots: MambaSlots, slot: int, rid: str) -> None:
    """`HybridReqToTokenPool.alloc([req])` gave req a row and `slot` (read off `req.kv`: this pool has no row-to-slot map)."""
    req = types.SimpleNamespace(rid=rid, kv=types.SimpleNamespace(mamba_pool_idx=torch.tensor(slot)))
    slots.note_taken(pool(8, []), [3], [req], 7)


def test_an_orphan_is_named_at_the_second_census_with_its_taker():
    p, slots, engine = probe(), MambaSlots(), pool(8, [1, 2, 3, 4, 5])
    taken(slots, 8, "req-a")
    tree = Tree([6, 7])
    slots.census(p, engine, tree)
    assert named(p) == []
    slots.census(p, engine, tree)
    (v,) = named(p)
    assert v["kind"] == schema.MAMBA_ORPHAN_SLOTS and v["slot_ids"] == [8] and v["requests"] == {"req-a": 1} and v["site"] == "site 7"
    slots.census(p, engine, tree)
    assert len(named(p)) == 1  # named once


class TakenWhileRead(MambaSlotAllocator):
    """The scheduler takes slot 1 for `req-b` right after a census has read the free list (which
    still holds it): the census runs on the writer's thread, beside the scheduler."""

    def __init__(self, slots: MambaSlots, size: int, free: list[int]) -> None:
        super().__init__(size, free)
        self.slots, self.read = slots, 0

    @property
    def free_slots(self) -> torch.Tensor:
        self.read += 1
        if self.read == 1:
            taken(self.slots, 1, "req-b")
        return self._free

    @free_slots.setter
    def free_slots(self, value: torch.Tensor) -> None:
        self._free = value


TakenWhileRead.__name__ = "MambaSlotAllocator"  # the census reads only that class's free list


def test_a_slot_taken_while_a_census_reads_keeps_its_taker():
    p, slots = probe(), MambaSlots()
    engine = pool(8, [])
    engine.mamba_allocator = TakenWhileRead(slots, 8, [1, 2, 3, 4, 5])
    slots.census(p, engine, Tree([6, 7, 8]))  # read slot 1 as free, while req-b took it
    assert slots.takers.of(1) == ("req-b", 7)
    for _ in range(2):  # req-b never gives it back
        slots.census(p, pool(8, [2, 3, 4, 5]), Tree([6, 7, 8]))
    (v,) = named(p)
    assert v["slot_ids"] == [1] and v["requests"] == {"req-b": 1}, v


def test_session_records_hold_slots():
    p, slots = probe(), MambaSlots()
    session = types.SimpleNamespace(mamba_pool_idx=torch.tensor(8), mamba_ping_pong_track_buffer=None)
    tree = Tree([6, 7], sessions={"s": session})
    for _ in range(2):
        slots.census(p, pool(8, [1, 2, 3, 4, 5]), tree)
    assert named(p) == [] and status(p) == []


def test_books_that_disagree_with_sglangs_counts_name_nothing():
    """The tree's count says 3 while its values read 2: the census says so and names no slot."""
    p, slots, engine = probe(), MambaSlots(), pool(8, [1, 2, 3, 4, 5])
    for _ in range(3):
        slots.census(p, engine, Tree([6, 7], counted=3))
    assert named(p) == []
    (census,) = [args for name, args in p.emitter.events if name == schema.MAMBA_POOL]
    assert census["books_disagree"] == 1 and census["unaccounted"] == 1


def test_a_slot_back_between_censuses_is_not_named():
    p, slots = probe(), MambaSlots()
    slots.census(p, pool(8, [1, 2, 3, 4, 5]), Tree([6, 7]))
    slots.census(p, pool(8, [1, 2, 3, 4, 5, 8]), Tree([6, 7]))
    slots.census(p, pool(8, [1, 2, 3, 4, 5]), Tree([6, 7]))
    assert named(p) == []


def test_a_prefill_picks_preallocated_slots_skip_the_round():
    p, slots, engine = probe(), MambaSlots(), pool(8, [1, 2, 3, 4, 5])
    engine.mamba_allocator._alloc_iter = iter([])
    for _ in range(3):
        slots.census(p, engine, Tree([6, 7]))
    assert p.emitter.events == []


def test_what_it_cannot_read_turns_it_off_said_once():
    p, slots, engine = probe(), MambaSlots(), pool(8, [])
    engine.mamba_allocator.free_slots = torch.zeros(2, dtype=torch.int64, device="meta")
    slots.census(p, engine, Tree([]))
    slots.census(p, engine, Tree([]))
    (s,) = status(p)
    assert s["component"] == "mamba_slots" and "synchronise" in s["reason"] and named(p) == []


def test_another_allocator_class_is_not_read():
    p, slots, engine = probe(), MambaSlots(), pool(8, [1])
    engine.mamba_allocator = types.SimpleNamespace(size=8, free_slots=torch.tensor([1]), available_size=lambda: 1)
    slots.census(p, engine, Tree([]))
    assert "whose free list this census does not read" in status(p)[0]["reason"]


def test_takers_are_read_from_the_pools_row_to_slot_map_in_one_gather():
    """SGLang 0.5.20+'s `HybridReqToTokenPool.alloc` writes `req_index_to_mamba_index_mapping[rows]`:
    a host pool's slots are read from it (the requests' own `kv` is not read), slot 0 (padding) and
    slots outside the pool dropped."""
    slots, engine = MambaSlots(), pool(8, [])
    engine.req_index_to_mamba_index_mapping = torch.tensor([0, 5, 0, 6, 9], dtype=torch.int32)
    reqs = [types.SimpleNamespace(rid=f"req-{n}", kv=None) for n in range(4)]
    slots.note_taken(engine, [1, 2, 3, 4], reqs, 9)
    assert [slots.takers.of(s) for s in (5, 6)] == [("req-0", 9), ("req-2", 9)]
    assert slots.takers.of(0)[0] == slots.takers.of(1)[0] == "unknown (taken before the probe watched)"
