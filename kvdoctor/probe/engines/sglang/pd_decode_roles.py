"""The hooks of the PD decode transfer ledger (`pd_decode`): what each mapped SGLang call tells it.

`DecodeTransferQueue.extend`/`add` (requests whose pages were sent to the prefill), SGLang's own
`poll_and_all_reduce` (the states it acts on), `Scheduler.abort_request` (the transfers it aborted),
`CommonKVManager.is_abort_release_safe` (the prefill's drain acks) and `DecodeReqToTokenPool.free`
(a row and its pages going back). Each runs under the ledger's lock; anything it does not understand
turns this ledger off, said once, and never reaches the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.engines.sglang.pd_decode import LEDGER, PdDecodeLedger, request_row
from kvdoctor.probe.engines.sglang.requests import ReqFreeRole

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


def state(probe: ProbeContext) -> PdDecodeLedger:
    return probe.state(LEDGER, PdDecodeLedger)


def guarded(probe: ProbeContext, work: Any, *args: Any) -> None:
    """Runs one hook's work under the state's lock; what it does not understand turns this ledger off."""
    pd = state(probe)
    try:
        with pd.lock:
            work(pd, probe, *args)
    except Exception as exc:
        probe.turn_off_ledger(LEDGER, "the PD decode transfer ledger", f"PD decode transfers not judged: {type(exc).__name__}: {exc}")


class TransferEnterRole(Role):
    """`DecodeTransferQueue.extend(decode_reqs)`: requests whose pages were sent to the prefill."""

    ledger = LEDGER
    reads = {"decode_reqs": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        value = hook.arg(args, kwargs, next(iter(self.reads)))
        decode_reqs = list(value) if isinstance(value, (list, tuple)) else [value]
        guarded(probe, PdDecodeLedger.enter_all, obj, decode_reqs)


class TransferAddRole(TransferEnterRole):
    """`DecodeTransferQueue.add(decode_req)`: one request."""

    reads = {"decode_req": 0}


class TransferPollsRole(Role):
    """`poll_and_all_reduce(pollers, ...)`: the states SGLang acts on, one per poller."""

    ledger = LEDGER
    reads = {"pollers": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if not state(probe).by_receiver or not isinstance(result, list):
            return
        pollers = hook.arg(args, kwargs, "pollers")
        guarded(probe, PdDecodeLedger.polled, list(pollers or ()), result)


class TransferAbortRole(Role):
    """`Scheduler.abort_request(recv_req)`: the transfers it aborted, read from their receivers."""

    ledger = LEDGER

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        queue = getattr(obj, "disagg_decode_transfer_queue", None)
        if queue is None or not state(probe).by_row:
            return
        guarded(probe, PdDecodeLedger.aborted, queue)


class TransferDrainRole(Role):
    """`CommonKVManager.is_abort_release_safe(bootstrap_room, required_acks)`: every prefill rank acked its drain."""

    ledger = LEDGER
    reads = {"bootstrap_room": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        guarded(probe, PdDecodeLedger.drain_answer, hook.arg(args, kwargs, "bootstrap_room"), bool(result))


class RowFreeRole(Role):
    """`DecodeReqToTokenPool.free(req)` (or a row index before 0.5.9): the request's row and pages go back."""

    ledger = LEDGER
    wants_site = True
    reads = {"req": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        if not state(probe).by_row:
            return None
        arg = hook.arg(args, kwargs, "req")
        rows = [arg] if isinstance(arg, int) else list(arg) if isinstance(arg, list) else [request_row(arg)]
        for row in rows:
            if isinstance(row, int):
                guarded(probe, PdDecodeLedger.released, row, probe.sites.name(site) if site else "unknown")
        return None


class RowAndRequestFreeRole(ReqFreeRole):
    """`DecodeReqToTokenPool.free(req)` where the map judges the decode server's request pool: the
    slot ledger's release of the row (`ReqFreeRole`) and this ledger's (`RowFreeRole`), in one hook
    (a method is hooked once). Each part runs while its own ledger is on. The transfer ledger's
    part is Python, so this role has no native fast path: one call per finished request."""

    fast_kind = ""
    wants_site = True
    row = RowFreeRole()

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        if LEDGER not in probe.ledgers_off:
            self.row.before(probe, hook, obj, args, kwargs, site)
        return super().before(probe, hook, obj, args, kwargs, site)


ROLES: dict[str, Role] = {
    "pd_transfer_enter": TransferEnterRole(),
    "pd_transfer_add": TransferAddRole(),
    "pd_transfer_polls": TransferPollsRole(),
    "pd_transfer_abort": TransferAbortRole(),
    "pd_transfer_drain": TransferDrainRole(),
    "pd_row_free": RowFreeRole(),
    "pd_req_free": RowAndRequestFreeRole(),
}
