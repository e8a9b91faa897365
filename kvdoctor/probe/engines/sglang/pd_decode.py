"""SGLang's PD disaggregation, decode side: each request in the `DecodeTransferQueue`, its transfer's
`KVPoll` state and age, and the release of its pages while the prefill may still write them.

A decode server preallocates a request's pages and sends their numbers to the prefill
(`send_metadata`), then waits in the transfer queue while the prefill writes into them. A request
aborted there (`Scheduler.abort_request` -> the receiver's `abort`) is polled Failed and released;
up to 0.5.18, and by default up to 0.5.20, its pages go back to the allocator at once, though the
prefill's writer may still be writing them, and the next request is handed them (sglang#24527: KV
corrupted across requests). PR#35049 (0.5.19, on by default from 0.5.21) holds them until every
prefill rank acks that its writes drained, or a timeout. A transfer that never leaves
WaitingForInput or Transferring holds its row and pages for good (sglang#9266; Mooncake's receiver
times out only WaitingForInput, PR#31800).

What this ledger sees, on the scheduler's thread: the requests `DecodeTransferQueue.extend`/`add`
take (their row, and the pages of the row from the request table when it is a host tensor: on a
device their numbers are not read, only counted); the states SGLang's own `poll_and_all_reduce`
returns for them (it never polls a receiver itself); the aborts `Scheduler.abort_request` made (the
receiver's own `conclude_state` or `abort_notified`, read after the call); the drain acks
`CommonKVManager.is_abort_release_safe` answered; and each row's release (`DecodeReqToTokenPool.free`).
A row released after a decode abort and before a drain ack is named, with the request, its pages and
the call site (an error); a transfer polled WaitingForInput or Transferring past the deadline
(`KVDOCTOR_PD_TRANSFER_DEADLINE_S`, 300 s by default, SGLang's own waiting timeout) is a warning with
its age. Not judged, and said in the release's `pd_transfer` event: the fake transfer backend's
(nothing writes) and failures the decode did not initiate through `abort_request` (the prefill's, a
receiver's own timeout); requests beyond MAX_TRANSFERS are counted, not followed. The queue's counts
by state and its oldest requests go to the trace when they change, at most once a second, and at exit.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.settings import DAY_S, env_number
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

LEDGER = "pd_decode"
QUEUE = "DecodeTransferQueue"
MAX_TRANSFERS = 8192  # requests followed at once; more are counted, not followed
MAX_PAGES_KEPT = 64  # page numbers kept per request (all are counted)
MAX_ROOMS = 1024  # drain answers remembered
OLDEST_SHOWN = 8
SUMMARY_PERIOD_S = 1.0
DEADLINE_S = 300.0
STATES = ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")  # KVPoll's values, in order
FAILED, WAITING, SUCCESS = 0, 2, 4
IN_FLIGHT = ("WaitingForInput", "Transferring")
FAKE = "FakeKVReceiver"
FAKE_NOT_JUDGED = "the fake transfer backend writes nothing into the pages"


class NotJudged(Exception):
    """The engine is not laid out as this ledger reads it."""


class Transfer:
    """One request in the transfer queue, as the ledger follows it."""

    __slots__ = (
        "rid",
        "room",
        "row",
        "receiver",
        "backend",
        "pages",
        "page_count",
        "entered_s",
        "state",
        "seen",
        "aborted_s",
        "at_abort",
        "stuck",
    )

    def __init__(self, rid: str, room: Any, row: int, receiver: Any, pages: list[int] | None, page_count: int) -> None:
        self.rid, self.room, self.row, self.receiver = rid, room, row, id(receiver)
        self.backend = type(receiver).__name__
        self.pages, self.page_count = pages, page_count
        self.entered_s = time.monotonic()
        self.state = "WaitingForInput"  # its pages were sent to the prefill before it entered the queue
        self.seen = -1  # the poll round that last returned its state
        self.aborted_s: float | None = None
        self.at_abort = ""
        self.stuck = False

    def brief(self, now: float) -> dict[str, Any]:
        return {"rid": self.rid, "room": self.room, "state": self.state, "age_s": round(now - self.entered_s, 3)}


class PdDecodeLedger:
    """Per process: the transfers followed (by row and by receiver), the drain answers, the counts."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.lock = threading.Lock()
        self.by_row: dict[int, Transfer] = {}
        self.by_receiver: dict[int, Transfer] = {}
        self.drained: dict[Any, bool] = {}
        self.counts = {"done": 0, "freed_in_flight": 0, "released_after_drain": 0, "released_not_judged": 0, "not_followed": 0}
        self.polls = 0
        self.said: tuple[Any, ...] | None = None
        self.last_summary = float("-inf")
        self.last_stuck_check = float("-inf")
        self.pages_read = ""
        self.deadline_s = _deadline()

    def periodic(self, probe: ProbeContext) -> None:
        return None  # counted on the scheduler's thread, in its own calls

    def close(self, probe: ProbeContext, reason: str) -> None:
        with self.lock:
            self.summary(probe, force=True)

    # ----- what the hooks report -----

    def enter_all(self, probe: ProbeContext, queue: Any, decode_reqs: list[Any]) -> None:
        for decode_req in decode_reqs:
            self.enter(probe, queue, decode_req)
        self.summary(probe)

    def enter(self, probe: ProbeContext, queue: Any, decode_req: Any) -> None:
        req, receiver = getattr(decode_req, "req", None), getattr(decode_req, "kv_receiver", None)
        row = request_row(req)
        if req is None or receiver is None or row is None:
            raise NotJudged(f"a {type(decode_req).__name__} without a request, a receiver or a row")
        if row in self.by_row:
            self.forget(self.by_row[row])
        if len(self.by_row) >= MAX_TRANSFERS:
            self.counts["not_followed"] += 1
            return
        pages, count = self.read_pages(probe, queue, req, row)
        transfer = Transfer(str(getattr(req, "rid", "?")), getattr(req, "bootstrap_room", None), row, receiver, pages, count)
        self.by_row[row] = transfer
        self.by_receiver[transfer.receiver] = transfer

    def read_pages(self, probe: ProbeContext, queue: Any, req: Any, row: int) -> tuple[list[int] | None, int]:
        """The pages the prefill was sent: the request's own slots of its row, as pages."""
        pool = getattr(getattr(queue, "tree_cache", None), "req_to_token_pool", None)
        if pool is None:
            pool = getattr(getattr(queue, "scheduler", None), "req_to_token_pool", None)
        if "DecodeReqToTokenPool" not in {c.__name__ for c in type(pool).__mro__}:
            raise NotJudged(f"the request pool is {type(pool).__name__}, whose release the map does not hook (DecodeReqToTokenPool.free)")
        allocator = getattr(getattr(queue, "tree_cache", None), "token_to_kv_pool_allocator", None)
        page_size = getattr(allocator, "page_size", 1)
        kv = getattr(req, "kv", None)
        start = int(getattr(kv, "cache_protected_len", None) or getattr(req, "cache_protected_len", 0) or 0)
        end = int(getattr(kv, "kv_allocated_len", None) or len(getattr(req, "origin_input_ids", ()) or ()))
        count = max(0, -(-end // page_size) - start // page_size)
        table: Any = getattr(pool, "req_to_token", None)
        device = getattr(table, "device", None)
        if table is None or getattr(device, "type", None) != "cpu":
            self.say_pages(
                probe, f"page numbers not read: the request table lives on {device} (reading it would synchronise); pages counted"
            )
            return None, count
        self.say_pages(probe, "page numbers read from the host request table")
        pages = (table[row, start:end] // page_size).unique()[:MAX_PAGES_KEPT]  # sorted, in torch: a long prompt stays cheap
        return [int(p) for p in pages.tolist()], count

    def say_pages(self, probe: ProbeContext, how: str) -> None:
        if how != self.pages_read:
            self.pages_read = how
            probe.emitter.emit(
                schema.PROBE_STATUS,
                {"component": "ledger", "state": "on", "ledger": LEDGER, "reason": f"PD decode transfer ledger on {QUEUE}: {how}"},
            )

    def polled(self, probe: ProbeContext, pollers: Any, polls: Any) -> None:
        self.polls += 1
        for poller, value in zip(pollers, polls, strict=False):
            decode_req = getattr(poller, "decode_req", None)  # HiCache's gated poller wraps the request
            receiver = getattr(decode_req, "kv_receiver", None) if decode_req is not None else poller
            transfer = self.by_receiver.get(id(receiver))
            if transfer is None or transfer.room != getattr(receiver, "bootstrap_room", transfer.room):
                continue
            state = STATES[int(value)] if 0 <= int(value) < len(STATES) else str(value)
            transfer.state, transfer.seen = state, self.polls
            if int(value) == SUCCESS:  # the writer finished: the pages are the request's
                self.counts["done"] += 1
                self.forget(transfer)
        now = time.monotonic()
        if now - self.last_stuck_check >= SUMMARY_PERIOD_S:
            self.last_stuck_check = now
            self.name_stuck(probe, now)
        self.summary(probe)

    def aborted(self, probe: ProbeContext, queue: Any) -> None:
        now = time.monotonic()
        for decode_req in list(getattr(queue, "queue", None) or ()):
            receiver = getattr(decode_req, "kv_receiver", None)
            transfer = self.by_receiver.get(id(receiver))
            if transfer is None or transfer.aborted_s is not None:
                continue
            concluded = getattr(receiver, "conclude_state", None)
            if (concluded is not None and int(concluded) == FAILED) or getattr(receiver, "abort_notified", False) is True:
                transfer.aborted_s, transfer.at_abort = now, transfer.state
                probe.emitter.emit(schema.PD_TRANSFER, {**transfer.brief(now), "event": "aborted by the decode (abort_request)"})

    def drain_answer(self, probe: ProbeContext, room: Any, drained: bool) -> None:
        """SGLang asked whether every prefill rank acked its drain for `room` (the last answer counts)."""
        self.drained.pop(room, None)
        self.drained[room] = drained
        while len(self.drained) > MAX_ROOMS:
            self.drained.pop(next(iter(self.drained)))

    def released(self, probe: ProbeContext, row: int, site: str) -> None:
        transfer = self.by_row.get(row)
        if transfer is None:
            return
        self.forget(transfer)
        now = time.monotonic()
        brief = transfer.brief(now)
        drained = self.drained.pop(transfer.room, None)
        if transfer.backend == FAKE or transfer.aborted_s is None:
            self.counts["released_not_judged"] += 1
            why = (
                FAKE_NOT_JUDGED
                if transfer.backend == FAKE
                else "no decode abort was seen (a failure the prefill reported, or polls this ledger does not see)"
            )
            probe.emitter.emit(
                schema.PD_TRANSFER,
                {**brief, "event": f"released, its transfer last seen {transfer.state}; not judged: {why}", "site": site},
            )
        elif drained:
            self.counts["released_after_drain"] += 1
            probe.emitter.emit(
                schema.PD_TRANSFER,
                {**brief, "event": "released after the prefill's drain ack", "held_s": round(now - transfer.aborted_s, 3), "site": site},
            )
        else:
            self.counts["freed_in_flight"] += 1
            self.name_freed(probe, transfer, now, site, drained)
        self.summary(probe)

    # ----- findings -----

    def name_freed(self, probe: ProbeContext, transfer: Transfer, now: float, site: str, drained: bool | None) -> None:
        probe.emitter.emit(
            schema.VIOLATION,
            {
                "kind": schema.PD_TRANSFER_FREED_IN_FLIGHT,
                "count": transfer.page_count,
                "allocator": QUEUE,
                "site": site,
                "requests": {transfer.rid: transfer.page_count},
                "page_ids": transfer.pages if transfer.pages is not None else [],
                "pages_read": transfer.pages is not None,
                "room": transfer.room,
                "state_at_abort": transfer.at_abort,
                "age_s": round(now - transfer.entered_s, 3),
                "since_abort_s": round(now - (transfer.aborted_s or now), 3),
                "backend": transfer.backend,
                "drain": "the deferred hold timed out without the prefill's drain ack" if drained is False else "no drain ack asked for",
            },
        )

    def name_stuck(self, probe: ProbeContext, now: float) -> None:
        for transfer in list(self.by_row.values()):
            if transfer.stuck or transfer.seen != self.polls or transfer.state not in IN_FLIGHT:
                continue
            age = now - transfer.entered_s
            if age < self.deadline_s:
                continue
            transfer.stuck = True
            probe.emitter.emit(
                schema.VIOLATION,
                {
                    "kind": schema.PD_TRANSFER_STUCK,
                    "count": 1,
                    "allocator": QUEUE,
                    "site": "",
                    "requests": {transfer.rid: 1},
                    "room": transfer.room,
                    "state": transfer.state,
                    "age_s": round(age, 3),
                    "deadline_s": self.deadline_s,
                    "page_count": transfer.page_count,
                    "page_ids": transfer.pages if transfer.pages is not None else [],
                    "backend": transfer.backend,
                },
            )

    def summary(self, probe: ProbeContext, force: bool = False) -> None:
        """The queue's counts by state and its oldest requests, when they changed (at most once a second)."""
        now = time.monotonic()
        if not force and now - self.last_summary < SUMMARY_PERIOD_S:
            return
        by_state: dict[str, int] = {}
        for transfer in self.by_row.values():
            by_state[transfer.state] = by_state.get(transfer.state, 0) + 1
        held = sum(1 for t in self.by_row.values() if t.aborted_s is not None)
        key = (tuple(sorted(by_state.items())), held, tuple(self.counts.values()))
        if key == self.said or (self.said is None and not self.by_row and not any(self.counts.values())):
            return
        self.said, self.last_summary = key, now
        oldest = sorted(self.by_row.values(), key=lambda t: t.entered_s)[:OLDEST_SHOWN]
        probe.emitter.emit(
            schema.PD_TRANSFERS,
            {
                "queue": QUEUE,
                "followed": len(self.by_row),
                "by_state": by_state,
                "aborted_held": held,
                **self.counts,
                "oldest": [t.brief(now) for t in oldest],
                "deadline_s": self.deadline_s,
            },
        )

    def forget(self, transfer: Transfer) -> None:
        self.by_row.pop(transfer.row, None)
        self.by_receiver.pop(transfer.receiver, None)


def _deadline() -> float:
    return env_number("KVDOCTOR_PD_TRANSFER_DEADLINE_S", DEADLINE_S, high=30 * DAY_S)


def request_row(req: Any) -> int | None:
    """A request's row: `req.kv.req_pool_idx` from 0.5.19, `req.req_pool_idx` before."""
    kv = getattr(req, "kv", None)
    row = getattr(kv, "req_pool_idx", None) if kv is not None else None
    if row is None:
        row = getattr(req, "req_pool_idx", None)
    return int(row) if isinstance(row, int) else None
