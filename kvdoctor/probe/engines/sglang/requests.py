"""What SGLang's request pool (`ReqToTokenPool`) tells the slot ledger: which rows are live, which
request holds each, and which slots each row points at. Releases before 0.5.9 allocate rows by
count and free them by index; from 0.5.9 the pool takes the requests themselves. The roles with
a `fast_kind` have their healthy case done by the native path, as roles.py's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role, resolve
from kvdoctor.probe.engines.sglang.state import sglang_state
from kvdoctor.probe.ledgers.requests import RID_NOT_PASSED

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


class RequestPoolRole(Role):
    """A request-pool role; it feeds the slot ledger."""

    ledger = "slots"


class ReqAllocRole(RequestPoolRole):
    fast_kind = "req_alloc"
    fast_names = {"requests": "reqs", "id": "rid"}  # what the native path reads (native.READS)
    reads = {"reqs": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if not result:
            return
        reqs = hook.arg(args, kwargs, "reqs")
        reqs = reqs if isinstance(reqs, (list, tuple)) else [None] * len(result)
        requests = sglang_state(probe).requests
        for req, index in zip(reqs, result, strict=False):
            requests.allocated(int(index), str(getattr(req, "rid", "?")), req)


class ReqAllocCountRole(RequestPoolRole):
    """Before 0.5.9: `alloc(need_size) -> rows`; the rows are given to requests afterwards, so the
    evidence names the row and says why it has no rid."""

    reads = {"need_size": 0}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        requests = sglang_state(probe).requests
        for index in result or []:
            requests.allocated(int(index), RID_NOT_PASSED)


class ReqFreeIndexRole(RequestPoolRole):
    """Before 0.5.9: `free(free_index)`, one row or a list of rows."""

    reads = {"free_index": 0}

    def rows(self, hook: Hook, args: Args, kwargs: Kwargs) -> list[int]:
        index = hook.arg(args, kwargs, "free_index")
        return [int(i) for i in (index if isinstance(index, (list, tuple)) else [index]) if isinstance(i, int)]

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        state = sglang_state(probe)
        rows = self.rows(hook, args, kwargs)
        for index in rows:
            state.check_release(obj, index)
        return rows

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = sglang_state(probe)
        for index in ctx or []:
            state.requests.freed(index)
        state.request_rows_freed()


class ReqFreeRole(RequestPoolRole):
    fast_kind = "req_free"
    fast_names = {"request": "req", "table": "req_to_token", "index": "req_pool_idx"}
    # `free(req)` releases through `free_rows([row])` on the same pool from 0.5.23: one release,
    # recorded once, by the outer call
    composite = True
    reads = {"req": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        req = hook.arg(args, kwargs, "req")
        index = resolve(req, hook.options.get("req_index_attr", "req_pool_idx"))
        if index is None and isinstance(req, int):
            index = req
        if isinstance(index, int):
            sglang_state(probe).check_release(obj, index)
        return index

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = sglang_state(probe)
        if isinstance(ctx, int):
            state.requests.freed(ctx)
        state.request_rows_freed()


class ReqFreeRowsRole(RequestPoolRole):
    fast_kind = "req_free_rows"
    fast_names = {"rows": "indices", "table": "req_to_token"}
    composite = True  # inside `free(req)` it is the same release (see ReqFreeRole)
    reads = {"indices": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        state = sglang_state(probe)
        for index in hook.arg(args, kwargs, "indices") or []:
            state.check_release(obj, int(index))
        return None

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = sglang_state(probe)
        for index in hook.arg(args, kwargs, "indices") or []:
            state.requests.freed(int(index))
        state.request_rows_freed()


class ReqWriteRole(RequestPoolRole):
    fast_kind = "req_write"
    fast_names = {"rows": "indices", "slots": "values"}
    reads = {"indices": 0, "values": 1}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        ledger = sglang_state(probe).primary
        if ledger is None:
            return
        indices = hook.arg(args, kwargs, "indices")
        values = hook.arg(args, kwargs, "values")
        if not isinstance(indices, tuple) or len(indices) != 2 or not hasattr(values, "numel"):
            return
        row = indices[0]
        if isinstance(row, int):
            owner: Any = row
        elif hasattr(row, "numel") and row.numel() == values.numel():
            owner = row
        else:
            return
        sglang_state(probe).note_row_write(obj, row, indices[1], values)
        with ledger.lock:
            ledger.on_owner(values, owner)


class ReqClearRole(RequestPoolRole):
    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = sglang_state(probe)
        state.requests.cleared()
        state.census_pending = True
