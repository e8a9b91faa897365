"""The host pool's page books (`host_slots.py`): what each rule names, counted once per broken
mention, on index tensors as SGLang's host pools hand them out. The real classes' case (sglang#13483
on SGLang 0.5.5.post3's HiCache, silent on 0.5.6): tests/integration/test_hicache_prefetch.py."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from kvdoctor.probe.engines.sglang.hicache import HostAllocRole
from kvdoctor.probe.engines.sglang.host_slots import HostSlots
from kvdoctor.trace import schema


class Emitter:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def emit(self, name: str, args: dict) -> None:
        self.events.append((name, args))


def probe() -> types.SimpleNamespace:
    return types.SimpleNamespace(emitter=Emitter(), sites=types.SimpleNamespace(name=lambda site: f"site {site}"))


def pool(slots: int = 32, page_size: int = 4, free: list[int] | None = None) -> types.SimpleNamespace:
    """What the books read of a host pool at first sight: its size, page size and free list."""
    listed = torch.arange(slots, dtype=torch.int64) if free is None else torch.tensor(free, dtype=torch.int64)
    return types.SimpleNamespace(size=slots, page_size=page_size, free_slots=listed)


def violations(p: types.SimpleNamespace) -> list[dict]:
    return [args for name, args in p.emitter.events if name == schema.VIOLATION]


def pages(*numbers: int, page_size: int = 4) -> torch.Tensor:
    return torch.tensor([n * page_size + k for n in numbers for k in range(page_size)], dtype=torch.int64)


def test_a_healthy_round_trip_names_nothing():
    p, host, books = probe(), pool(), HostSlots()
    books.handed_out(p, host, pages(0, 1), 1)
    books.queued(p, host, pages(1), 2)
    books.given_back(p, host, pages(1), 3)
    books.given_back(p, host, pages(0), 3)
    books.handed_out(p, host, pages(1, 0), 1)
    assert violations(p) == [] and not books.off


def test_a_page_given_back_twice_in_one_call_is_a_double_free():
    """SGLang's host free appends what it is given: a page named twice in one call is listed twice."""
    p, host, books = probe(), pool(), HostSlots()
    books.handed_out(p, host, pages(2, 3), 7)
    books.given_back(p, host, torch.cat([pages(2, 3), pages(3)]), 9)
    (v,) = violations(p)
    assert v["kind"] == schema.DOUBLE_FREE and v["count"] == 4 and v["page_size"] == 4
    assert v["slot_ids"] == [12, 13, 14, 15] and v["site"] == "site 9" and v["allocated_at"] == {"site 7": 4}
    assert v["given_back_before_at"] == {"none seen (named twice in this call)": 4}


def test_a_page_given_back_while_free_names_the_first_free():
    p, host, books = probe(), pool(), HostSlots()
    books.handed_out(p, host, pages(5), 1)
    books.given_back(p, host, pages(5), 2)
    books.given_back(p, host, pages(5), 3)
    (v,) = violations(p)
    assert v["kind"] == schema.DOUBLE_FREE and v["site"] == "site 3" and v["given_back_before_at"] == {"site 2": 4}


def test_queued_twice_is_named_at_the_second_queuing_and_not_again_at_the_drain():
    """sglang#13483's shape: the tail queued by two IO-thread paths, then one drain frees the queue."""
    p, host, books = probe(), pool(), HostSlots()
    books.handed_out(p, host, pages(0, 1, 2, 3), 1)
    books.queued(p, host, pages(2, 3), 10)  # _page_transfer
    books.queued(p, host, pages(2, 3), 11)  # prefetch_io_aux_func
    books.given_back(p, host, torch.cat([pages(2, 3), pages(2, 3)]), 12)  # the scheduler's drain
    (v,) = violations(p)
    assert v["kind"] == schema.DOUBLE_FREE and v["count"] == 8 and v["site"] == "site 11"
    assert v["why"] == "queued for release while already queued" and v["queued_for_release_at"] == {"site 10": 8}
    books.handed_out(p, host, pages(2), 1)
    books.given_back(p, host, pages(2), 12)
    books.given_back(p, host, pages(2), 12)  # a later double free of the same page is a new one
    assert len(violations(p)) == 2


def test_a_page_handed_out_twice_is_a_double_alloc():
    p, host, books = probe(), pool(), HostSlots()
    books.handed_out(p, host, pages(4), 1)
    books.handed_out(p, host, pages(4, 6), 2)
    (v,) = violations(p)
    assert v["kind"] == schema.DOUBLE_ALLOC and v["count"] == 4 and v["allocated_at"] == {"site 1": 4}


def test_first_sight_reads_the_free_list_and_clear_reads_it_again():
    """Pages missing from the pool's free list when it is first met are held (by someone before the
    probe watched); after `clear()` every page is free again."""
    host = pool(free=list(range(16, 32)))  # pages 0-3 handed out before the probe watched
    p, books = probe(), HostSlots()
    books.given_back(p, host, pages(0), 3)
    assert violations(p) == []
    books.given_back(p, host, pages(5), 3)
    assert violations(p)[0]["allocated_at"] == {"before the probe watched": 4}
    host.free_slots = torch.arange(32, dtype=torch.int64)
    books.cleared(p, host)
    books.handed_out(p, host, pages(1, 2), 1)
    assert len(violations(p)) == 1


def test_a_pool_first_met_at_an_alloc_is_read_before_it():
    """A probe that came late (an attach) meets the pool at an alloc: the hook's `before` reads it
    while its free list still holds what the call hands out, so those slots are not held already."""
    p, host = probe(), pool()
    states: dict = {}
    p.state = lambda key, factory: states.setdefault(key, factory(p))
    p.fixes = frozenset()
    role, hook = HostAllocRole(), types.SimpleNamespace()
    ctx = role.before(p, hook, host, (8,), {}, 1)
    handed = host.free_slots[:8]
    host.free_slots = host.free_slots[8:]  # the pool's own alloc of pages 0 and 1
    role.after(p, hook, host, (8,), {}, handed, ctx)
    assert violations(p) == [] and not states["hicache"].slots.off


def test_release_slots_of_0_5_23_count_as_free():
    host = pool(free=list(range(0, 16)))
    host.release_slots = [pages(6, 7)]
    p, books = probe(), HostSlots()
    books.handed_out(p, host, pages(6), 1)
    assert violations(p) == []


@pytest.mark.parametrize(
    "indices, why", [(torch.tensor([4, 400]), "outside"), (torch.zeros(4, dtype=torch.int64, device="meta"), "synchronise")]
)
def test_what_it_cannot_follow_turns_only_it_off_said_once(indices, why):
    p, host, books = probe(), pool(), HostSlots()
    books.given_back(p, host, indices, 1)
    books.given_back(p, host, indices, 1)
    (status,) = [args for name, args in p.emitter.events if name == schema.PROBE_STATUS]
    assert status["component"] == "host_slots" and why in status["reason"] and books.off
    assert violations(p) == [] and not books.books


def test_a_pool_too_large_is_not_followed():
    p, books = probe(), HostSlots()
    books.handed_out(p, types.SimpleNamespace(size=1 << 30, page_size=1, free_slots=np.zeros(0)), pages(0), 1)
    assert "more than" in books.off
