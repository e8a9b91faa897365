"""Request rows left behind (`request_rows_leaked`): the request table's weak references to each row's
request, and the writer's rule for naming a row (two rounds in a row; a row whose request still lives
only across a round with no hooked call). The real servers' cases: test_pd_decode_server.py, and the
demo's `row-leak` on SGLang's own ReqToTokenPool in test_sglang_ledger.py."""

from __future__ import annotations

import gc
import types

from kvdoctor.probe.engines.sglang.left_rows import GONE, LeftRows
from kvdoctor.probe.ledgers.requests import RequestTable
from kvdoctor.trace import schema


class Req:
    def __init__(self, rid: str, row: int | None) -> None:
        self.rid = rid
        self.kv = types.SimpleNamespace(req_pool_idx=row)


class SlottedReq:
    __slots__ = ("rid", "kv")  # no __weakref__: a weak reference cannot be taken

    def __init__(self, rid: str, row: int) -> None:
        self.rid = rid
        self.kv = types.SimpleNamespace(req_pool_idx=row)


class HookedPool:
    """A request pool whose row methods all carry the probe's mark (what coverage.is_hook reads)."""


for _name in ("alloc", "free", "write", "clear"):

    def _method(self, *args):
        return None

    _method.__kvdoctor_role__ = "req"  # type: ignore[attr-defined]
    setattr(HookedPool, _name, _method)


class UnhookedPool(HookedPool):
    def free(self, req):  # its own free: rows given back past the hooks
        return None


def test_a_row_whose_request_is_gone_or_names_no_row_is_left_and_a_freed_one_is_not():
    table = RequestTable()
    kept, dropped, moved, freed = Req("a", 1), Req("b", 2), Req("c", 3), Req("d", 4)
    for req in (kept, dropped, moved, freed):
        table.allocated(req.kv.req_pool_idx, req.rid, req)
    table.allocated(5, "by count")  # no request passed: not judged
    table.freed(4)
    del dropped
    gc.collect()
    moved.kv.req_pool_idx = None
    assert table.left_rows("kv.req_pool_idx") == {2: ("b", GONE), 3: ("c", "its request names no row now")}
    assert 4 not in table.holders and set(table.holders) == {1, 2, 3}


def test_a_request_without_weak_references_is_not_judged():
    table = RequestTable()
    table.allocated(7, "s", SlottedReq("s", 7))
    assert table.live == {7: "s"} and table.holders == {} and table.left_rows("kv.req_pool_idx") == {}


def _state(table: RequestTable, pool: object) -> types.SimpleNamespace:
    emitted: list[dict] = []
    judging = types.SimpleNamespace(
        engine_pools_by_allocator={1: (object(), pool)},
        request_methods=lambda: {"HookedPool": ["alloc", "free", "write", "clear"]},
        request_index_attr=lambda: "kv.req_pool_idx",
    )
    state = types.SimpleNamespace(requests=table, judging=judging, probe=types.SimpleNamespace(calls=0), emitted=emitted)
    state.emit_violations = emitted.extend
    state.request_rows_freed = lambda: None
    return state


def test_a_row_is_named_at_the_second_round_that_finds_it_and_then_counts_as_finished():
    table = RequestTable()
    gone = Req("gone", 2)
    table.allocated(2, "gone", gone)
    del gone
    gc.collect()
    state, left = _state(table, HookedPool()), LeftRows()
    left.tick(state)
    assert state.emitted == []  # one round found it
    state.probe.calls = 10  # a gone request is named even while the engine is busy
    left.tick(state)
    (named,) = state.emitted
    assert named["kind"] == schema.REQUEST_ROWS_LEAKED and named["slot_ids"] == [2] and named["allocator"] == "HookedPool"
    assert named["requests"] == {"req_pool_idx 2 (rid gone)": 1} and named["why"] == GONE
    assert table.live == {} and table.finished == {2: "gone"}  # the census judges what it points at
    left.tick(state)
    assert len(state.emitted) == 1  # named once


def test_a_living_request_naming_no_row_is_named_only_across_a_quiet_round():
    table = RequestTable()
    req = Req("mid-release", 3)
    table.allocated(3, req.rid, req)
    req.kv.req_pool_idx = None  # as SGLang's free does, before the hook's after marks the row freed
    state, left = _state(table, HookedPool()), LeftRows()
    for calls in (1, 2, 3):  # hooked calls between every round: a release may be in progress
        state.probe.calls = calls
        left.tick(state)
    assert state.emitted == []
    left.tick(state)  # no hooked call since the last round
    assert [e["why"] for e in state.emitted] == ["its request names no row now"]


def test_no_row_is_judged_while_the_request_pool_gives_rows_back_past_the_hooks():
    table = RequestTable()
    table.allocated(2, "gone", Req("gone", 2))
    gc.collect()  # its request is gone at once
    state, left = _state(table, UnhookedPool()), LeftRows()
    for _ in range(3):
        left.tick(state)
    assert state.emitted == [] and "past the hooks" in left.why_not_judged(state)
    left.at_exit(state)
    assert state.emitted == []


def test_at_exit_one_look_names_the_gone_rows_only():
    table = RequestTable()
    alive = Req("alive", 1)
    alive.kv.req_pool_idx = None
    table.allocated(1, "alive", alive)
    table.allocated(2, "gone", Req("gone", 2))
    gc.collect()
    state, left = _state(table, HookedPool()), LeftRows()
    left.at_exit(state)
    assert [e["slot_ids"] for e in state.emitted] == [[2]] and 1 in table.live
