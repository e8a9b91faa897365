"""What each hooked SGLang allocator, radix tree and request pool method means to the slot ledger.

Allocation roles (`alloc`, `alloc_extend`, `alloc_decode`) hand slots to a request and check the
`last_loc` they are given; free roles return slots (or whole pages); tree roles move slots to
and from the radix tree (tree_roles.py); request-pool roles say which rows are live and which slots each row
points at (`req_write_spans`: speculative decoding's row writer, a function around a kernel;
`req_write_extend`: a prefill batch's, likewise).
`retract_path`, `preempt_path` and `batch_result` say which path gives a row back and at which forward step
(release_paths.py).
`last_loc_source` remembers which rows a computed `last_loc` was read from, so a stale one can be
named and, with `recompute-last-loc`, read again.

A role with a `fast_kind` has its healthy case done by the native path's ledger operation of
that kind, reading the arguments and attributes its `fast_names` names: a change to what such a
role records is made there too (tests/integration/test_native.py compares the two paths).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdoctor.probe import native
from kvdoctor.probe.base import fixes
from kvdoctor.probe.base.context import Args, Hook, Kwargs, NoteRole, Role, argument
from kvdoctor.probe.base.objects import own
from kvdoctor.probe.base.shutdown_role import ShutdownRole
from kvdoctor.probe.engines.sglang import coverage, mm_inputs
from kvdoctor.probe.engines.sglang.prefill import ReqWriteExtendRole
from kvdoctor.probe.engines.sglang.release_paths import PREEMPT, RETRACT
from kvdoctor.probe.engines.sglang.requests import (
    ReqAllocCountRole,
    ReqAllocRole,
    ReqClearRole,
    ReqFreeIndexRole,
    ReqFreeRole,
    ReqFreeRowsRole,
    ReqWriteRole,
)
from kvdoctor.probe.engines.sglang.speculative import ReqWriteSpansRole, RestoreStateRole
from kvdoctor.probe.engines.sglang.state import MAX_LAST_LOC_SOURCES, group_open, sglang_state
from kvdoctor.probe.engines.sglang.tree_roles import TreeEvictRole, TreeInsertKeyValueRole, TreeInsertRole, TreeResetRole, TreeUnlockRole
from kvdoctor.probe.ledgers.slots import SlotLedger

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


class SlotRole(Role):
    """A role that feeds the slot ledger."""

    ledger = "slots"


class SlotNoteRole(NoteRole):
    ledger = "slots"


class AllocRole(SlotRole):
    fast_kind = "alloc"
    fast_names = {"loc": "last_loc"}  # what the native path reads (native.READS says of each kind)
    composite = True
    wants_site = True
    only_page_starts = False

    def prefix_lens(self, args: Args, kwargs: Kwargs) -> Any:
        return None

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        state = sglang_state(probe)
        ledger = state.ledger_for(obj)
        state.census_if_due()
        pos = hook.positions.get("last_loc")
        source = None
        if pos is not None:
            last_loc = argument(args, kwargs, "last_loc", pos)
            if last_loc is not None:
                source = state.last_loc_source(last_loc)
                ledger.check_last_loc(last_loc, site, source[1] if source else None)
        return (ledger, site, source)

    def rewrite(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, ctx: Any) -> tuple[Args, Kwargs]:
        pos = hook.positions.get("last_loc")
        if pos is None or ctx is None:
            return args, kwargs
        last_loc = argument(args, kwargs, "last_loc", pos)
        if last_loc is None:
            return args, kwargs
        ledger, site, source = ctx
        fixed = last_loc
        if "recompute-last-loc" in probe.fixes and source is not None and source[2] is not None:
            recomputed = fixes.recompute_last_loc(source[2], source[1], source[3], like=last_loc)
            _report_fix(probe, ledger, "recompute-last-loc", fixed, recomputed, site)
            fixed = recomputed
        if "clamp-last-loc" in probe.fixes:
            clamped = fixes.clamp_last_loc(fixed, ledger.rows, ledger.page_size, self.prefix_lens(args, kwargs))
            _report_fix(
                probe, ledger, "clamp-last-loc", fixed, clamped, site, moved_into_rows=[ledger.rows - ledger.page_size, ledger.rows - 1]
            )
            fixed = clamped
        if fixed is last_loc:
            return args, kwargs
        if "last_loc" in kwargs:
            return args, {**kwargs, "last_loc": fixed}
        return args[:pos] + (fixed,) + args[pos + 1 :], kwargs

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if result is None or ctx is None:
            return
        ledger, site = ctx[0], ctx[1]
        with ledger.lock:
            ledger.on_alloc(result, site, only_page_starts=self.only_page_starts)


def _report_fix(probe: ProbeContext, ledger: SlotLedger, name: str, before: Any, after: Any, site: int, **evidence: Any) -> None:
    """Counts what a last_loc fix changed. On the host the changed values are counted; on a GPU
    that would be a read-back, so the calls it applied to are counted instead, and said so."""
    if ledger.xp.sync_free_branching:
        changed = int((after != before).sum())
        if changed:
            probe.fixed(name, changed, site=probe.sites.name(site), allocator=ledger.name, **evidence)
    else:
        probe.fixed(
            name, 1, site=probe.sites.name(site), allocator=ledger.name, counted="calls (values are not read back on a GPU)", **evidence
        )


class ExtendRole(AllocRole):
    only_page_starts = True
    reads = {"prefix_lens": 0}

    def prefix_lens(self, args: Args, kwargs: Kwargs) -> Any:
        """alloc_extend(prefix_lens, ...): the tokens before last_loc + 1."""
        return argument(args, kwargs, "prefix_lens", self.reads["prefix_lens"])


class DecodeRole(ExtendRole):
    reads = {"seq_lens": 0}

    def prefix_lens(self, args: Args, kwargs: Kwargs) -> Any:
        """alloc_decode(seq_lens, ...): seq_lens counts the new token."""
        seq_lens = argument(args, kwargs, "seq_lens", self.reads["seq_lens"])
        return None if seq_lens is None else seq_lens - 1


class FreeRole(SlotRole):
    fast_kind = "free"
    composite = True
    wants_site = True
    as_pages = False

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        if group_open(obj, hook.options):
            return None  # staged in the group; recorded when the group ends
        return (sglang_state(probe).ledger_for(obj), site)

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        if ctx is None:
            return
        ledger, site = ctx
        index = args[0] if args else next(iter(kwargs.values()), None)
        if index is None or not hasattr(index, "numel") or index.numel() == 0:
            return
        with ledger.lock:
            ledger.on_free(index, site, evicting=native.evicting(), as_pages=self.as_pages)

    def rewrite(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, ctx: Any) -> tuple[Args, Kwargs]:
        if "dedup-free" not in probe.fixes or ctx is None or not args:
            return args, kwargs
        ledger, site = ctx
        kept, dropped = fixes.drop_already_free(ledger, args[0], as_pages=self.as_pages)
        if dropped:
            probe.fixed("dedup-free", dropped, site=probe.sites.name(site), allocator=ledger.name)
            return (kept,) + args[1:], kwargs
        return args, kwargs


class FreePagesRole(FreeRole):
    as_pages = True


class GroupEndRole(SlotRole):
    wants_site = True

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        attr = hook.options.get("group_pages_attr")
        staged = list(getattr(obj, attr, None) or []) if attr else []
        return (sglang_state(probe).ledger_for(obj), site, staged)

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        ledger, site, staged = ctx
        with ledger.lock:
            for pages in staged:
                if hasattr(pages, "numel") and pages.numel():
                    ledger.on_free(pages, site, evicting=native.evicting(), as_pages=True)
        sglang_state(probe).judge_deferred_releases()


class ClearRole(SlotRole):
    composite = True

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = sglang_state(probe)
        if id(obj) not in state.ledgers and coverage.constructing(obj):
            # a pool clearing itself as it is built: its ledger, made at its first use, starts all
            # free as this would, and by then a composite holding it (an SWA pool) names its part
            return
        ledger = state.ledger_for(obj)
        with ledger.lock:
            ledger.reset_all_free()


class LastLocSourceRole(SlotRole):
    """`get_last_loc(req_to_token, req_pool_indices, prefix_lens)`: remember which rows it read."""

    fast_kind = "last_loc"  # the native path stores the same tuple (native.wrap_function)
    fast_names = {"table": "req_to_token", "rows": "req_pool_indices_tensor", "prefix": "prefix_lens_tensor"}
    sources_max = MAX_LAST_LOC_SOURCES
    reads = {"req_to_token": 0, "req_pool_indices_tensor": 1, "prefix_lens_tensor": 2}

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        sglang_state(probe).remember_last_loc_source(
            result,
            hook.arg(args, kwargs, "req_pool_indices_tensor"),
            hook.arg(args, kwargs, "req_to_token"),
            hook.arg(args, kwargs, "prefix_lens_tensor"),
        )


class RetractPathRole(SlotRole):
    """`ScheduleBatch.retract_decode`: the rows it gives back are the retract path's (release_paths.py)."""

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        overlap = own(obj, "enable_overlap")
        return sglang_state(probe).paths.enter(RETRACT, obj, overlap if isinstance(overlap, bool) else None)

    def finally_(self, probe: ProbeContext, ctx: Any) -> None:
        if ctx is not None:
            sglang_state(probe).paths.leave(ctx)


class PreemptPathRole(SlotRole):
    """`PrefillAdder.preempt_to_schedule`: the rows its `release_req` gives back, and what the
    ledger flags meanwhile, are the preemption path's (release_paths.py, sglang#17797)."""

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        return sglang_state(probe).paths.enter(PREEMPT, own(obj, "running_batch"), None)

    def finally_(self, probe: ProbeContext, ctx: Any) -> None:
        if ctx is not None:
            sglang_state(probe).paths.leave(ctx)


class BatchResultRole(SlotRole):
    """`Scheduler.process_batch_result(batch, result)`: the rows given back while it runs are the
    finish path's; once it returned, the releases held for the forward in flight are judged, and
    the batch's finished requests that still hold multimodal features are noted (mm_inputs.py)."""

    reads = {"batch": 0}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        return sglang_state(probe).paths.result_started(obj, hook.arg(args, kwargs, "batch"))

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = sglang_state(probe)
        state.emit_violations(state.paths.judge_in_flight(ctx[0]))
        mm_inputs.after_result(probe, obj, hook.arg(args, kwargs, "batch"))

    def finally_(self, probe: ProbeContext, ctx: Any) -> None:
        if ctx is not None:
            sglang_state(probe).paths.leave(ctx[1])


ROLES: dict[str, Role] = {
    "alloc": AllocRole(),
    "alloc_extend": ExtendRole(),
    "alloc_decode": DecodeRole(),
    "free": FreeRole(),
    "free_segment": FreeRole(),
    "free_pages": FreePagesRole(),
    "group_begin": SlotNoteRole(),
    "group_end": GroupEndRole(),
    "restore_state": RestoreStateRole(),
    "merge": SlotNoteRole(),
    "clear": ClearRole(),
    "tree_insert": TreeInsertRole(),
    "tree_insert_key_value": TreeInsertKeyValueRole(),
    "tree_evict": TreeEvictRole(),
    "tree_lock": SlotNoteRole(),
    "tree_unlock": TreeUnlockRole(),
    "tree_unlock_by_id": SlotNoteRole(),
    "tree_reset": TreeResetRole(),
    "req_alloc": ReqAllocRole(),
    "req_alloc_count": ReqAllocCountRole(),
    "req_free": ReqFreeRole(),
    "req_free_index": ReqFreeIndexRole(),
    "req_free_rows": ReqFreeRowsRole(),
    "req_write": ReqWriteRole(),
    "req_write_spans": ReqWriteSpansRole(),
    "req_write_extend": ReqWriteExtendRole(),
    "req_clear": ReqClearRole(),
    "last_loc_source": LastLocSourceRole(),
    "shutdown": ShutdownRole(),
    "retract_path": RetractPathRole(),
    "preempt_path": PreemptPathRole(),
    "batch_result": BatchResultRole(),
}
