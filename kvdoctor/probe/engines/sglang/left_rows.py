"""Request rows left behind: a row of SGLang's request pool whose request is gone while no free of
the row was seen, named `request_rows_leaked` with the row and its request.

SGLang gives a request a row of `req_to_token_pool` at its first prefill and takes it back at its
release (`free(req)`). A release that skips it leaves the row held by nobody: SGLang's idle check
says "req_to_token_pool memory leak detected!" and no more (with its strict mode off), and the slot
ledger, whose table still lists the row live, would never see the engine idle again, so its idle
censuses would stop. The table keeps a weak reference to each row's request (taken at the hooked
`alloc`, by the native path too); the writer thread asks, each round, which live rows' requests
were collected.

Judged only while every request pool the engine names is hooked wherever it gives rows back
(`coverage.unhooked_methods`): a row freed past the hooks would look left. A row is named when two
rounds in a row find it, and never while a streaming session holds its record (SGLang 0.5.23's
`detach_kv` moves a finished request's row to the session: the tree's own `session_records()` says
which rows; where they cannot be read this round, nothing is named this round). Named once: the row
then counts as finished, so what it still points at is judged by the censuses. A request still
referenced is not gone: an idle scheduler keeps its last batch, and that batch's requests, until
the next one, so a row left in the last batch before a pause is named once the engine serves again
(at exit, not at all: missed, never falsely named).
"""

from __future__ import annotations

from typing import Any

from kvdoctor.probe.base.vocabulary import MAX_IDS_IN_EVIDENCE
from kvdoctor.probe.engines.sglang import coverage
from kvdoctor.trace import schema

WHY = "its request object is gone"
SITE = "never given back (no free of the row seen)"


class LeftRows:
    """The rows found left at the last round. `state` is the engine's `SglangState` (its request
    table, coverage judge, radix tree, probe and emitter)."""

    def __init__(self) -> None:
        self.suspects: set[int] = set()
        self.off = ""  # why rows are no longer judged (an error of this rule turns only it off, said once)

    def why_not_judged(self, state: Any) -> str:
        pools = [pair[1] for pair in list(state.judging.engine_pools_by_allocator.values()) if pair[1] is not None]
        if not pools:
            return "no request pool seen yet"
        methods = state.judging.request_methods()
        for pool in pools:
            unhooked = coverage.unhooked_methods(pool, methods)
            if unhooked:
                return f"the request pool gives rows back past the hooks ({', '.join(unhooked[:2])})"
        return ""

    def found(self, state: Any) -> dict[int, str] | None:
        """The left rows now, less those a session holds; None when the sessions cannot be read."""
        if not state.requests.holders or self.why_not_judged(state):
            return {}
        left: dict[int, str] = state.requests.left_rows()
        if not left:
            return left
        held = session_rows(state.tree)
        if held is None:
            return None
        return {row: rid for row, rid in left.items() if row not in held}

    def tick(self, state: Any) -> None:
        """One writer round: names the rows two rounds in a row found left."""
        self.guarded(state, self._tick)

    def at_exit(self, state: Any) -> None:
        """Before the exit census: the rows left, at one look (a collected request cannot come
        back, and at exit no later round will look again)."""
        self.guarded(state, self._at_exit)

    def guarded(self, state: Any, work: Any) -> None:
        if self.off:
            return
        try:
            work(state)
        except Exception as exc:
            self.off = f"request rows left behind not judged: {type(exc).__name__}: {exc}"
            state.probe.emitter.emit(schema.PROBE_STATUS, {"component": "left_rows", "state": "partial", "reason": self.off})

    def _tick(self, state: Any) -> None:
        found = self.found(state)
        if found is None:
            return  # the suspects wait for a round that can read the sessions
        due = {row: rid for row, rid in found.items() if row in self.suspects}
        self.suspects = set(found) - set(due)
        if due:
            self.name(state, due)

    def _at_exit(self, state: Any) -> None:
        found = self.found(state)
        if found:
            self.name(state, found)

    def name(self, state: Any, due: dict[int, str]) -> None:
        pools = {type(pair[1]).__name__ for pair in list(state.judging.engine_pools_by_allocator.values()) if pair[1] is not None}
        rows = sorted(due)
        requests = {f"req_pool_idx {row} (rid {due[row]})": 1 for row in rows}
        for row in rows:
            state.requests.freed(row)  # counted as finished from here: what it points at is judged by the censuses
        args: dict[str, Any] = {
            "kind": schema.REQUEST_ROWS_LEAKED,
            "count": len(rows),
            "allocator": "/".join(sorted(pools)),
            "site": SITE,
            "slot_ids": rows[:MAX_IDS_IN_EVIDENCE],
            "requests": requests,
            "why": WHY,
        }
        state.emit_violations([args])
        state.request_rows_freed()  # the engine may be idle now: its census is asked for


def session_rows(tree: Any) -> set[int] | None:
    """The request rows SGLang's streaming sessions hold, from the tree's own `session_records()`
    (none where the tree has no sessions); None when they cannot be read now (the scheduler
    changing them as they are read)."""
    if tree is None or getattr(type(tree), "session_records", None) is None:
        return set()
    try:
        records = dict(tree.session_records())
        return {row for row in (getattr(kv, "req_pool_idx", None) for kv in records.values()) if isinstance(row, int)}
    except Exception:
        return None
