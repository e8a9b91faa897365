"""Blocks a finished vLLM request keeps for a KV connector: held since when, by whom, until when.

vLLM's scheduler lets a KV connector keep a finished request's blocks. `_free_request` asks
`_connector_finished` (the connector's `request_finished`); when that delays the free, the blocks
stay allocated until the worker reports the request in `finished_sending` (or `finished_recving`)
and `_free_blocks` returns them. An abort of a request still waiting for a remote KV load
(`finish_requests` -> `_free_request(delay_free_blocks=True)`) keeps them the same way. A
connector that never reports strands them for good (vllm#35931, vllm#41269, vllm#46283), and the
block ledger cannot say so: such a request is still live to it, so its blocks are not orphans.

Roles (the "connector" ledger, off unless all three hooks resolve):

- `vllm_request_finish`  `Scheduler._free_request(request, delay_free_blocks)`: a request
  finished; when `_free_blocks` did not run inside it, its blocks are now held;
- `vllm_connector_veto`  `Scheduler._connector_finished(request)`: whether the connector itself
  asked to keep the blocks (its result's first item);
- `vllm_blocks_release`  `Scheduler._free_blocks(request)`: the hold ends, the blocks go back.

A hold is recorded once ("held by <connector> since T": request, status, block ids) and dropped
when it ends. The writer thread looks at the oldest holds against the deadline
(`KVDOCTOR_CONNECTOR_DEADLINE_S`, 480 s by default: vLLM's own abort timeout for NIXL and
Mooncake) and emits `connector_overdue` once for each hold that outlives it, again at exit for
those still held, and `connector_late_release` when an overdue one ends after all. Nothing runs
per scheduler step and nothing is emitted for a hold that ends in time; at most `MAX_HOLDS`
holds are remembered (the rest are counted). A scheduler without a KV or EC connector costs two
attribute reads per finished request: the ledger is made when the first request with a connector
finishes.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.base.settings import DAY_S, env_number
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

ENV_DEADLINE_S = "KVDOCTOR_CONNECTOR_DEADLINE_S"
DEFAULT_DEADLINE_S = 480.0  # vLLM's own: NIXL's decoder_kv_blocks_ttl, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
MAX_HOLDS = 4096  # holds remembered at once; past that they are counted, not named
MAX_BLOCK_IDS = 64  # block ids kept per hold

# Why the blocks are held (`reason` in the events).
HELD_BY_CONNECTOR = "connector_delayed_free"  # request_finished asked to keep them (a send pending)
AWAITING_REMOTE_KV = "awaiting_remote_kv"  # aborted while its remote KV load was still pending
HELD_BY_EC_CONNECTOR = "ec_connector_delayed_free"  # the encoder-cache connector asked to keep them


def deadline_from_env() -> float:
    """The deadline in seconds (`KVDOCTOR_CONNECTOR_DEADLINE_S`); a value that is not a number
    leaves the default."""
    return env_number(ENV_DEADLINE_S, DEFAULT_DEADLINE_S, high=30 * DAY_S)


def wall_clock_text(seconds: float) -> str:
    """UTC, to the millisecond: what a reader compares with the server's own logs."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds % 1 * 1000):03d}Z"


@dataclasses.dataclass
class Finishing:
    """One `_free_request` call in progress: what the calls inside it said."""

    request: str
    scheduler_delay: bool  # delay_free_blocks=True: an abort while a remote KV load was pending
    connector_delay: bool = False
    freed: bool = False


@dataclasses.dataclass
class Hold:
    request: str
    holder: str  # the connector's class name
    reason: str
    status: str  # the request's status when it finished
    since: float  # time.monotonic()
    since_wall: float  # time.time()
    block_ids: list[int]
    blocks: int

    def evidence(self, now: float, deadline_s: float) -> dict[str, Any]:
        return {
            "request": self.request,
            "holder": self.holder,
            "reason": self.reason,
            "status": self.status,
            "blocks": self.blocks,
            "block_ids": self.block_ids,
            "held_since": wall_clock_text(self.since_wall),
            "held_s": round(now - self.since, 3),
            "deadline_s": deadline_s,
        }


class _CurrentFinish(threading.local):
    def __init__(self) -> None:
        self.finishing: Finishing | None = None


class ConnectorHolds:
    """Per process: the holds in progress, oldest first, and those already past the deadline."""

    def __init__(self, probe: ProbeContext) -> None:
        self.probe = probe
        self.deadline_s = deadline_from_env()
        self.pending: collections.OrderedDict[str, Hold] = collections.OrderedDict()  # within the deadline
        self.overdue: dict[str, Hold] = {}
        self.lock = threading.Lock()
        self.current = _CurrentFinish()
        self.stats = {"connector_holds": 0, "connector_releases": 0, "connector_overdue": 0, "connector_holds_untracked": 0}
        self.closed = False
        probe.status(
            "on",
            f"connector ledger: blocks a KV connector keeps after its request finished are followed; "
            f"deadline {self.deadline_s:g} s ({ENV_DEADLINE_S})",
            ledger="connector",
            deadline_s=self.deadline_s,
        )

    # ----- from the hooks (the scheduler's thread) -----

    def begin(self, scheduler: Any, finishing: Finishing, status: str) -> None:
        rid = finishing.request
        if finishing.connector_delay:
            holder, reason = _class_name(getattr(scheduler, "connector", None), "KV connector"), HELD_BY_CONNECTOR
        elif finishing.scheduler_delay:
            holder, reason = _class_name(getattr(scheduler, "connector", None), "KV connector"), AWAITING_REMOTE_KV
        else:
            holder, reason = _class_name(getattr(scheduler, "ec_connector", None), "EC connector"), HELD_BY_EC_CONNECTOR
        block_ids, blocks = _blocks_of(scheduler, rid)
        with self.lock:
            if rid in self.pending or rid in self.overdue:
                return
            if len(self.pending) + len(self.overdue) >= MAX_HOLDS:
                self.stats["connector_holds_untracked"] += 1
                return
            self.pending[rid] = Hold(rid, holder, reason, status, time.monotonic(), time.time(), block_ids, blocks)
            self.stats["connector_holds"] += 1

    def release(self, rid: str) -> None:
        if rid not in self.pending and rid not in self.overdue:
            return  # the common case, a request nobody held: two dict lookups
        with self.lock:
            hold = self.pending.pop(rid, None)
            late = None
            if hold is None:
                late = self.overdue.pop(rid, None)
            if hold is not None or late is not None:
                self.stats["connector_releases"] += 1
            if late is not None:
                self.probe.emitter.emit(schema.CONNECTOR_LATE_RELEASE, late.evidence(time.monotonic(), self.deadline_s))

    # ----- the writer thread, the census, the exit -----

    def check(self, *, final: bool = False) -> None:
        """Holds that just passed the deadline get their `connector_overdue`; with `final`, every
        overdue hold still held gets one more, with its age at the end."""
        now = time.monotonic()
        due: list[Hold] = []
        emit = self.probe.emitter.emit
        with self.lock:  # emitted under it: a hold counted overdue is in the trace as such, in order
            while self.pending:
                rid, hold = next(iter(self.pending.items()))
                if now - hold.since < self.deadline_s:
                    break
                del self.pending[rid]
                self.overdue[rid] = hold
                self.stats["connector_overdue"] += 1
                due.append(hold)
            if final:
                due = list(self.overdue.values())
            for hold in due:
                emit(schema.CONNECTOR_OVERDUE, {**hold.evidence(now, self.deadline_s), "still_held_at": "exit" if final else "deadline"})

    def held_requests(self) -> set[str]:
        with self.lock:
            return set(self.pending) | set(self.overdue)

    def census_args(self) -> dict[str, Any]:
        """What a block census says about the holds, beside its orphans."""
        now = time.monotonic()
        with self.lock:
            holds = list(self.pending.values()) + list(self.overdue.values())
            out: dict[str, Any] = dict(self.stats)
        out["connector_held_requests"] = len(holds)
        out["connector_deadline_s"] = self.deadline_s
        if holds:
            oldest = min(holds, key=lambda h: h.since)
            out["connector_oldest_hold"] = oldest.evidence(now, self.deadline_s)
        return out

    def periodic(self, probe: ProbeContext) -> None:
        if probe.ledger_is_on("connector"):
            self.check()

    def close(self, probe: ProbeContext, reason: str) -> None:
        if self.closed or not probe.ledger_is_on("connector"):
            return
        self.closed = True
        self.check(final=True)


def holds(probe: ProbeContext) -> ConnectorHolds:
    return probe.state("vllm_connector", ConnectorHolds)


def _class_name(obj: Any, fallback: str) -> str:
    return type(obj).__name__ if obj is not None else fallback


def _request_id(args: Args, kwargs: Kwargs) -> str | None:
    request = kwargs.get("request", args[0] if args else None)
    rid = getattr(request, "request_id", None)
    return str(rid) if rid is not None else None


def _blocks_of(scheduler: Any, rid: str) -> tuple[list[int], int]:
    """The request's block ids (every KV cache group), read once when its hold begins. Evidence
    only: a manager that cannot say leaves the hold without ids rather than the probe off."""
    try:
        groups = scheduler.kv_cache_manager.get_block_ids(rid)
        ids = [int(b) for group in groups for b in group]
    except Exception:
        return [], 0
    return ids[:MAX_BLOCK_IDS], len(ids)


# ----- roles -----


class ConnectorRole(Role):
    """A role that feeds the connector ledger."""

    ledger = "connector"


class RequestFinishRole(ConnectorRole):
    """`Scheduler._free_request`: the calls inside it say whether the blocks went back."""

    reads = {"request": 0, "delay_free_blocks": 1}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        if getattr(obj, "connector", None) is None and getattr(obj, "ec_connector", None) is None:
            return None  # no connector: nothing can keep the blocks, and the ledger is never made
        state = holds(probe)
        rid = _request_id(args, kwargs)
        finishing = Finishing(rid, bool(hook.arg(args, kwargs, "delay_free_blocks"))) if rid is not None else None
        previous = state.current.finishing
        state.current.finishing = finishing
        return (state, finishing, previous)

    def finally_(self, probe: ProbeContext, ctx: Any) -> None:
        if ctx is not None:
            ctx[0].current.finishing = ctx[2]

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if ctx is None:
            return
        state, finishing, _ = ctx
        if finishing is None or finishing.freed:
            return
        request = kwargs.get("request", args[0] if args else None)
        status = getattr(getattr(request, "status", None), "name", None)
        state.begin(obj, finishing, str(status) if status is not None else "")


class ConnectorVetoRole(ConnectorRole):
    """`Scheduler._connector_finished` -> (delay_free_blocks, kv_xfer_params)."""

    reads = {"request": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = probe.states.get("vllm_connector")
        finishing = state.current.finishing if isinstance(state, ConnectorHolds) else None
        if finishing is not None and isinstance(result, tuple) and result and result[0]:
            if finishing.request == _request_id(args, kwargs):
                finishing.connector_delay = True


class BlocksReleaseRole(ConnectorRole):
    """`Scheduler._free_blocks`: the request's blocks go back (within `_free_request`, or later)."""

    reads = {"request": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = probe.states.get("vllm_connector")
        rid = _request_id(args, kwargs)
        if rid is None or not isinstance(state, ConnectorHolds):
            return  # no connector has held anything in this process
        finishing = state.current.finishing
        if finishing is not None and finishing.request == rid:
            finishing.freed = True
        state.release(rid)


ROLES: dict[str, Role] = {
    "vllm_request_finish": RequestFinishRole(),
    "vllm_connector_veto": ConnectorVetoRole(),
    "vllm_blocks_release": BlocksReleaseRole(),
}
