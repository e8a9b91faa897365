"""Which path gave a request's row back (retract, finish) and at which forward step, and the slot
overlap scheduling still has in flight for it.

With overlap scheduling (SGLang's default) the scheduler prepares forward N+1, one new slot per
running request written to its row, before it processes forward N's result. A request that
finishes in forward N's result, or is retracted while forward N+1 is planned, gives back its row
while the slot of the forward still in flight is its own. Up to 0.5.5 SGLang frees that slot when
it processes the in-flight forward's result; from 0.5.5.post1 the release frees it itself
(`kv_allocated_len`). 0.5.3.post2 and 0.5.3.post3 retract through `cache_finished_req`, which
frees only the slots before it, and their result processing skips retracted requests: the slot
is never freed (sglang#11970; 0.5.4 frees it there, sglang PR#11981).

So on an overlapped engine (a batch's or the scheduler's `enable_overlap`), the slots a row still
owns at its release are held in flight, and judged once the next forward result after the
release was processed (`Scheduler.process_batch_result` returned): those still unfreed are named
with the path, the scheduler's forward count at the release (`forward_ct`) and the request.
Releases are judged on host ledgers (`SglangState.check_release`); a device ledger's rolling
census names what stays unfreed, without the path.

Priority preemption (`PrefillAdder.preempt_to_schedule`, from 0.5.3) gives back the rows of the
running requests it preempts (`ScheduleBatch.release_req`). A request that finished in the last
forward result was released then, but stays in the running batch until `update_running_batch`
filters it: up to 0.5.8 preemption can pick it and release it again (sglang#17797; 0.5.3-0.5.5
free its slots a second time, 0.5.5.post1-0.5.8 stop at SGLang's own assert; 0.5.9 skips finished
requests, PR#18694). What the host ledger flags inside a preemption (a double free) is named with
the path, the forward count and the request whose row the preemption gave back last.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.objects import own
from kvdoctor.probe.ledgers.busy import held_in_flight, leaked_at_release, leaked_in_flight
from kvdoctor.probe.ledgers.requests import RID_NOT_PASSED

if TYPE_CHECKING:
    from kvdoctor.probe.ledgers.slots import SlotLedger

RETRACT = "retract (ScheduleBatch.retract_decode)"
FINISH = "finish (Scheduler.process_batch_result)"
PREEMPT = "preempt (PrefillAdder.preempt_to_schedule)"
NAMED_IN_VIOLATIONS = (PREEMPT,)  # paths whose ledger violations carry the path (retract/finish: judge_release)
MAX_IN_FLIGHT_RELEASES = 4096  # releases held for the in-flight forward; past it the oldest is judged at once
MAX_ROWS_NAMED = 1 << 14  # rows of one batch whose request is looked up at a release


@dataclasses.dataclass
class InFlight:
    """A release whose slots the in-flight forward may still free."""

    ledger: SlotLedger
    pages: Any
    row: int
    rid: str
    context: dict[str, Any]
    wait_for: int  # the result processing (counted from 1) that must have returned first


class ReleasePaths:
    """The path releasing rows now, the scheduler's forward count, and the releases held in flight.
    Only the scheduler's thread changes it (the hooked calls); `pending` is swapped whole."""

    def __init__(self) -> None:
        self.path = ""  # the hooked path releasing rows now ("" outside one)
        self.batch: Any = None  # that path's batch, only during the call: its requests name the rows
        self._rids: dict[int, str] | None = None  # row -> rid of `batch`, built at its first release
        self.overlap = False  # the engine prepares the next forward before processing a result
        self.forward_ct: int | None = None  # the scheduler's forward count, as last read
        self.results_started = 0
        self.pending: list[InFlight] = []
        self.released = ""  # the request whose row the path gave back last ("" before any)

    # ----- the hooked paths -----

    def enter(self, path: str, batch: Any, overlap: bool | None) -> tuple[str, Any, dict[int, str] | None]:
        previous = (self.path, self.batch, self._rids)
        self.path, self.batch, self._rids, self.released = path, batch, None, ""
        if overlap is not None:
            self.overlap = overlap
        return previous

    def leave(self, previous: tuple[str, Any, dict[int, str] | None]) -> None:
        self.path, self.batch, self._rids = previous
        self.released = ""

    def result_started(self, scheduler: Any, batch: Any) -> tuple[int, tuple[str, Any, dict[int, str] | None]]:
        """A forward result is being processed: releases in it are the finish path's."""
        forward_ct = own(scheduler, "forward_ct")
        if isinstance(forward_ct, int):
            self.forward_ct = forward_ct
        self.results_started += 1
        return self.results_started, self.enter(FINISH, batch, own(scheduler, "enable_overlap") is True)

    # ----- a release -----

    def context(self, row: int) -> dict[str, Any]:
        """What the evidence of a release of `row` says of its path and step ({} outside a path)."""
        if not self.path:
            return {}
        out: dict[str, Any] = {"path": self.path}
        if self.forward_ct is not None:
            out["forward_ct"] = self.forward_ct
        rid = self._rid_of(row)
        if rid:
            out["rid"] = rid
        return out

    def note_release(self, row: int) -> None:
        """A row given back inside a path (a second release of it too, which `context` never sees)."""
        if self.path:
            rid = self._rid_of(row)
            self.released = f"req_pool_idx {row} (rid {rid})" if rid else f"req_pool_idx {row}"

    def during(self) -> dict[str, Any]:
        """What a ledger violation flagged now says of the path ({} outside the paths named in them)."""
        if self.path not in NAMED_IN_VIOLATIONS:
            return {}
        out: dict[str, Any] = {"path": self.path}
        if self.forward_ct is not None:
            out["forward_ct"] = self.forward_ct
        if self.released:
            out["released_request"] = self.released
        return out

    def _rid_of(self, row: int) -> str:
        """The rid of the path's request in `row` (the pool itself names none before 0.5.9)."""
        if self._rids is None:
            self._rids = {}
            reqs = own(self.batch, "reqs")
            for req in reqs[:MAX_ROWS_NAMED] if isinstance(reqs, list) else []:
                index, rid = own(req, "req_pool_idx"), own(req, "rid")
                if isinstance(index, int) and isinstance(rid, str):
                    self._rids[index] = rid
        return self._rids.get(row, "")

    def judge_release(self, ledger: SlotLedger, slots: Any, row: int, rid: str, context: dict[str, Any]) -> list[dict[str, Any]]:
        """The violations of a row's release: none yet where a forward in flight may still free
        what the row owns (then held and judged by `judge_in_flight`)."""
        rid = context.get("rid", rid) if rid in ("?", RID_NOT_PASSED) else rid
        if not self.overlap:
            violation = leaked_at_release(ledger, slots, row, rid)
            return [] if violation is None else [{**violation, **_step(context)}]
        pages = held_in_flight(ledger, slots, row)
        if pages is None:
            return []
        self.pending.append(InFlight(ledger, pages, row, rid, context, self.results_started + 1))
        if len(self.pending) <= MAX_IN_FLIGHT_RELEASES:
            return []
        oldest = self.pending.pop(0)
        return self._judge([oldest], "the held releases outgrew their bound before a forward result came")

    def judge_in_flight(self, done: int) -> list[dict[str, Any]]:
        """Once the result processing numbered `done` returned: the held releases it settles."""
        if not self.pending:
            return []
        due = [p for p in self.pending if p.wait_for <= done]
        if not due:
            return []
        self.pending = [p for p in self.pending if p.wait_for > done]
        return self._judge(due, f"not freed once the next forward result was processed (forward count {self.forward_ct})")

    def judge_all_held(self, why: str) -> list[dict[str, Any]]:
        pending, self.pending = self.pending, []
        return self._judge(pending, why)

    def _judge(self, releases: list[InFlight], why: str) -> list[dict[str, Any]]:
        out = []
        for held in releases:
            violation = leaked_in_flight(held.ledger, held.pages, held.row, held.rid)
            if violation is not None:
                out.append({**violation, **_step(held.context), "in_flight": why})
        return out


def _step(context: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in context.items() if k in ("path", "forward_ct")}
