"""Request rows left behind (`request_rows_leaked`): the request table's weak references to each row's
request, and the writer's rule for naming a row (its request gone two rounds in a row, and no
streaming session holding its record). The real servers' cases: test_pd_decode_server.py, and the
demo's `row-leak` on SGLang's own ReqToTokenPool in test_sglang_ledger.py."""

from __future__ import annotations

import gc
import types

from kvdoctor.probe.engines.sglang.left_rows import WHY, LeftRows
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


def test_a_row_whose_request_is_gone_is_left_and_a_freed_or_living_one_is_not():
    table = RequestTable()
    kept, dropped, moved, freed = Req("a", 1), Req("b", 2), Req("c", 3), Req("d", 4)
    for req in (kept, dropped, moved, freed):
        table.allocated(req.kv.req_pool_idx, req.rid, req)
    table.allocated(5, "by count")  # no request passed: not judged
    table.freed(4)
    del dropped, req
    gc.collect()
    moved.kv = types.SimpleNamespace(req_pool_idx=None)  # its record handed to a session (detach_kv): not judged
    assert table.left_rows() == {2: "b"}
    assert 4 not in table.holders and set(table.holders) == {1, 2, 3}


def test_a_request_without_weak_references_is_not_judged():
    table = RequestTable()
    table.allocated(7, "s", SlottedReq("s", 7))
    assert table.live == {7: "s"} and table.holders == {} and table.left_rows() == {}


class Tree:
    """A tree with streaming sessions, as SGLang 0.5.23's names the records they hold."""

    def __init__(self, records: dict | None = None, fails: bool = False) -> None:
        self.records, self.fails = records or {}, fails

    def session_records(self) -> dict:
        if self.fails:
            raise RuntimeError("dictionary changed size during iteration")
        return self.records


def _state(table: RequestTable, pool: object, tree: object = None) -> types.SimpleNamespace:
    emitted: list[dict] = []
    judging = types.SimpleNamespace(
        engine_pools_by_allocator={1: (object(), pool)}, request_methods=lambda: {"HookedPool": ["alloc", "free", "write", "clear"]}
    )
    state = types.SimpleNamespace(requests=table, judging=judging, tree=tree, emitted=emitted)
    state.emit_violations = emitted.extend
    state.request_rows_freed = lambda: None
    return state


def test_a_row_is_named_at_the_second_round_that_finds_it_and_then_counts_as_finished():
    table = RequestTable()
    table.allocated(2, "gone", Req("gone", 2))
    gc.collect()
    state, left = _state(table, HookedPool(), Tree()), LeftRows()
    left.tick(state)
    assert state.emitted == []  # one round found it
    left.tick(state)
    (named,) = state.emitted
    assert named["kind"] == schema.REQUEST_ROWS_LEAKED and named["slot_ids"] == [2] and named["allocator"] == "HookedPool"
    assert named["requests"] == {"req_pool_idx 2 (rid gone)": 1} and named["why"] == WHY
    assert table.live == {} and table.finished == {2: "gone"}  # the census judges what it points at
    left.tick(state)
    assert len(state.emitted) == 1  # named once


def test_a_row_a_streaming_session_holds_is_not_named_and_unreadable_sessions_name_nothing():
    table = RequestTable()
    table.allocated(3, "in a session", Req("in a session", 3))
    table.allocated(4, "left", Req("left", 4))
    gc.collect()  # both requests gone; the session keeps row 3's record (detach_kv)
    tree = Tree(fails=True)
    state, left = _state(table, HookedPool(), tree), LeftRows()
    for _ in range(3):  # the sessions cannot be read: no round names anything
        left.tick(state)
    assert state.emitted == []
    tree.fails, tree.records = False, {"session-1": types.SimpleNamespace(req_pool_idx=3)}
    left.tick(state)
    left.tick(state)
    assert [e["slot_ids"] for e in state.emitted] == [[4]] and 3 in table.live


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


def test_an_error_of_the_rule_turns_only_it_off_and_says_so():
    table = RequestTable()
    table.allocated(2, "gone", Req("gone", 2))
    gc.collect()
    said: list[tuple[str, dict]] = []
    state = _state(table, HookedPool(), Tree())
    state.probe = types.SimpleNamespace(emitter=types.SimpleNamespace(emit=lambda name, args: said.append((name, args))))
    state.judging.request_methods = lambda: 1 / 0  # what the rule does not understand
    left = LeftRows()
    left.tick(state)
    left.tick(state)
    assert [(name, args["component"], args["state"]) for name, args in said] == [(schema.PROBE_STATUS, "left_rows", "partial")]
    assert "ZeroDivisionError" in left.off and state.emitted == []
