"""Request rows left behind: a row of SGLang's request pool whose request is gone (or names no row
now) while no free of the row was seen, named `request_rows_leaked` with the row and its request.

SGLang gives a request a row of `req_to_token_pool` at its first prefill and takes it back at its
release (`free(req)`). A release that skips it leaves the row held by nobody: SGLang's idle check
says "req_to_token_pool memory leak detected!" and no more (with its strict mode off), and the slot
ledger, whose table still lists the row live, would never see the engine idle again, so its idle
censuses would stop. The table keeps a weak reference to each row's request (taken at the hooked
`alloc`, by the native path too); the writer thread asks, each round, which live rows' requests are
collected or no longer name their row.

Judged only while every request pool the engine names is hooked wherever it gives rows back
(`coverage.unhooked_methods`): a row freed past the hooks would look left. A row is named when two
rounds in a row find it, and one whose request still lives (it names no row now) only when no hooked
call ran between them, so a release in progress on the scheduler's thread is never caught halfway.
Named once: the row then counts as finished, so what it still points at is judged by the censuses.
A request still referenced is not gone: an idle scheduler keeps its last batch, and that batch's
requests, until the next one, so a row left in the last batch before a pause is named once the
engine serves again (at exit, not at all: missed, never falsely named).
"""

from __future__ import annotations

from typing import Any

from kvdoctor.probe.base.vocabulary import MAX_IDS_IN_EVIDENCE
from kvdoctor.probe.engines.sglang import coverage
from kvdoctor.trace import schema

GONE = "its request object is gone"
SITE = "never given back (no free of the row seen)"


class LeftRows:
    """The rows found left at the last round, and the hooked-call count then. `state` is the
    engine's `SglangState` (its request table, coverage judge, probe and emitter)."""

    def __init__(self) -> None:
        self.suspects: dict[int, tuple[str, str]] = {}
        self.calls_last = -1

    def why_not_judged(self, state: Any) -> str:
        pools = [pair[1] for pair in state.judging.engine_pools_by_allocator.values() if pair[1] is not None]
        if not pools:
            return "no request pool seen yet"
        methods = state.judging.request_methods()
        for pool in pools:
            unhooked = coverage.unhooked_methods(pool, methods)
            if unhooked:
                return f"the request pool gives rows back past the hooks ({', '.join(unhooked[:2])})"
        return ""

    def tick(self, state: Any) -> None:
        """One writer round: names the rows two rounds in a row found left."""
        calls = state.probe.calls
        quiet, self.calls_last = calls == self.calls_last, calls
        if not state.requests.holders or self.why_not_judged(state):
            self.suspects = {}
            return
        found = state.requests.left_rows(state.judging.request_index_attr())
        due = {row: seen for row, seen in found.items() if row in self.suspects and (seen[1] == GONE or quiet)}
        self.suspects = {row: seen for row, seen in found.items() if row not in due}
        if due:
            self.name(state, due)

    def at_exit(self, state: Any) -> None:
        """Before the exit census: the rows whose request is gone, at one look (a collected request
        cannot come back, and at exit no later round will look again)."""
        if not state.requests.holders or self.why_not_judged(state):
            return
        found = state.requests.left_rows(state.judging.request_index_attr())
        due = {row: seen for row, seen in found.items() if seen[1] == GONE}
        if due:
            self.name(state, due)

    def name(self, state: Any, due: dict[int, tuple[str, str]]) -> None:
        pools = {type(pair[1]).__name__ for pair in state.judging.engine_pools_by_allocator.values() if pair[1] is not None}
        by_why: dict[str, list[int]] = {}
        for row, (_rid, why) in sorted(due.items()):
            by_why.setdefault(why, []).append(row)
        for why, rows in by_why.items():
            requests = {state.requests.describe(row): 1 for row in rows}  # while live: "req_pool_idx N (rid X, live)"
            for row in rows:
                state.requests.freed(row)  # counted as finished from here: what it points at is judged by the censuses
            args: dict[str, Any] = {
                "kind": schema.REQUEST_ROWS_LEAKED,
                "count": len(rows),
                "allocator": "/".join(sorted(pools)),
                "site": SITE,
                "slot_ids": rows[:MAX_IDS_IN_EVIDENCE],
                "requests": {key.replace(", live)", ")"): n for key, n in requests.items()},
                "why": why,
            }
            state.emit_violations([args])
        state.request_rows_freed()  # the engine may be idle now: its census is asked for
