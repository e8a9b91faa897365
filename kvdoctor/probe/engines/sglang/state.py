"""SGLang's per-process bookkeeping: one slot ledger per token-to-KV allocator, the live request
rows, the radix tree last seen, and when to take a census.

A census reads a whole ledger back, so it runs when the engine is idle (the last request row was
freed; at most one per `Probe.idle_census_interval_s`, taken before the next allocation, or from
the writer thread once the engine has been quiet for QUIET_S), at exit, and when the launcher is
about to kill the process (`census_at_shutdown`, see `probe/base/shutdown.py`). The allocator's own
free list and the tree's sizes go into it: a disagreement with SGLang shows in the same event.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvdoctor.probe import native
from kvdoctor.probe.base.context import positive_ints
from kvdoctor.probe.base.rank import ledger_name
from kvdoctor.probe.base.settings import env_positive
from kvdoctor.probe.engines.sglang import coverage, swa_sides
from kvdoctor.probe.engines.sglang.adopt import adopt, host_free_pages, needs_adoption, say_unproven
from kvdoctor.probe.engines.sglang.judging import CoverageJudge
from kvdoctor.probe.engines.sglang.left_rows import LeftRows
from kvdoctor.probe.engines.sglang.release_paths import ReleasePaths
from kvdoctor.probe.ledgers.busy import ROLLING_CENSUS_INTERVAL_S, RollingCensus
from kvdoctor.probe.ledgers.launch import register_device_ledger
from kvdoctor.probe.ledgers.requests import RequestTable
from kvdoctor.probe.ledgers.slots import SlotLedger
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

MAX_LAST_LOC_SOURCES = 8  # recent get_last_loc results kept to name their rows: few, each holds tensors (64 cost 4% in bench_probe)
ENV_ROLLING_CENSUS_S = "KVDOCTOR_ROLLING_CENSUS_S"
# What the native path calls on the state, by operation (context.c's keys); the request table's are its own.
NATIVE_CONTEXT = {"census": "census_if_due", "tree_seen": "tree", "row_written": "note_row_write", "rows_released": "request_rows_freed"}
QUIET_S = 0.5  # an idle engine this long without a release gets its census from the writer thread
SHUTDOWN_BUSY_WAIT_S = 3.0  # asked for a census at shutdown while busy: wait this long for quiet, then the rolling one stands


class SglangState:
    """See the module's docstring; which of its ledgers may judge orphans: `judging` (a `CoverageJudge`)."""

    def __init__(self, probe: ProbeContext) -> None:
        self.probe = probe
        self.requests = RequestTable()
        self.ledgers: dict[int, SlotLedger] = {}
        self.hosts: dict[int, Any] = {}  # id(ledger) -> its allocator
        self.primary: SlotLedger | None = None  # the first allocator: req_to_token writes name its slots
        self.tree: Any = None  # the radix tree last seen, for the census's sizes
        # id(last_loc tensor) -> (tensor, req_pool_indices, req_to_token, prefix_lens)
        self.last_loc_sources: dict[int, tuple[Any, Any, Any, Any]] = {}
        self._census_pending = False
        self.last_idle_census = -1e9
        self.last_release_s = -1e9
        self.deferred_releases: list[tuple[Any, int, str, dict[str, Any]]] = []  # (slots, row, rid, path) judged at a group's end
        self.paths = ReleasePaths()  # which path releases rows, at which step; releases held for a forward in flight
        self.row_extent: np.ndarray | None = None  # per row: the furthest req_to_token position written
        self.rolling: dict[int, RollingCensus] = {}
        self.rolling_interval_s = env_positive(ENV_ROLLING_CENSUS_S, ROLLING_CENSUS_INTERVAL_S)
        self.speculative = coverage.SpeculativeRows()  # the engine's speculative algorithm, once an object names it
        self.judging = CoverageJudge(self)
        self._calls_last_round = -1
        self.quiet_rounds = 0  # writer rounds in a row with no live request and no hooked call
        self.left_rows = LeftRows()  # live rows whose request is gone, their free never seen
        native.set_context(self, self.requests, self.last_loc_sources, {**NATIVE_CONTEXT, **self.requests.native_names})

    @property
    def census_pending(self) -> bool:
        """An idle census is due: the next allocation takes it (the native path steps aside)."""
        return self._census_pending

    @census_pending.setter
    def census_pending(self, value: bool) -> None:
        self._census_pending = value
        self._divert()

    def _divert(self) -> None:
        """Allocations take the Python path while a census is due or the engine is still sought."""
        native.set_divert(self._census_pending or self.speculative.seeks_left > 0)

    # ----- ledgers -----

    def ledger_for(self, allocator: Any) -> SlotLedger:
        ledger = self.ledgers.get(id(allocator := swa_sides.full_side(allocator)))  # an SWA pool's tree, rows: its full part's
        if ledger is not None:
            return ledger
        size, page_size = positive_ints(allocator, "size", "page_size")
        name = ledger_name(type(allocator).__name__, len(self.ledgers), coverage.part_name(allocator))
        device = getattr(allocator, "device", "cpu")
        probe = self.probe
        ledger = SlotLedger(
            name=name, size=size, page_size=page_size, device=device, emit=self._emit_from_ledger, requests=self.requests, sites=probe.sites
        )
        self.ledgers[id(allocator)] = ledger
        self.hosts[id(ledger)] = allocator
        if self.primary is None and swa_sides.may_be_primary(name):
            self.primary = ledger
        status = {
            "component": "ledger",
            "state": "on",
            "reason": f"ledger for {name}",
            "allocator": name,
            "size": size,
            "page_size": page_size,
            "device": str(device),
            "crash_box": getattr(ledger, "crash_box_off", "") or "on",  # kvdoctor/probe/ledgers/crash_box.py
        }
        free_pages = host_free_pages(allocator)
        found: dict[str, Any] | None = None
        if needs_adoption(ledger, free_pages):
            found = adopt(
                self.requests,
                self.probe.sites,
                ledger,
                allocator,
                free_pages,
                self.judging.map_classes("tree"),
                self.judging.request_index_attr(),
            )
            status.update(found)
            read = f"{found['free_slots']} slots free, {found['tree_slots']} in the tree, {found['live_requests']} live request(s)"
            if found["verified"]:
                status["reason"] = (
                    f"ledger for {name}, adopted in use: {read}, {found['held_by_no_one_slots']} held by no one (leaked before "
                    "attach); the books agree with SGLang's own counters"
                )
            else:
                status["reason"] = f"ledger for {name}, adopted in use: {read}; {found['unproven_slots']} held then are not judged"
        probe.emitter.emit(schema.PROBE_STATUS, status)
        if found is not None and not found["verified"]:
            say_unproven(probe, name, found)
        self.judging.dirty = True
        view = coverage.engine_view(allocator)
        if view is not None:
            self.judging.note_engine(view)
        if self.speculative.start():
            self._divert()
        self.judging.judge_ledgers()
        if probe.rendezvous is not None:
            probe.rendezvous.register()
        registered = native.register_ledger(allocator, ledger, self.allocator_options(allocator))
        registered = register_device_ledger(allocator, ledger) or registered
        if registered and self.primary is ledger:
            native.set_primary(allocator)
        return ledger

    def tree_ledger(self, tree: Any) -> SlotLedger | None:
        """The ledger of the allocator a radix tree frees into (None if the tree names none)."""
        allocator = getattr(tree, "token_to_kv_pool_allocator", None)
        if allocator is None:
            return None
        if tree is not self.tree:
            self.judging.note_engine(tree)
        self.tree = tree
        return self.ledger_for(allocator)

    def remember_last_loc_source(self, last_loc: Any, req_indices: Any, req_to_token: Any, prefix_lens: Any) -> None:
        sources = self.last_loc_sources
        sources[id(last_loc)] = (last_loc, req_indices, req_to_token, prefix_lens)
        if len(sources) > MAX_LAST_LOC_SOURCES:
            sources.pop(next(iter(sources)))

    def last_loc_source(self, last_loc: Any) -> tuple[Any, Any, Any, Any] | None:
        source = self.last_loc_sources.get(id(last_loc))
        return source if source is not None and source[0] is last_loc else None

    # ----- a request's release -----

    def note_row_write(self, pool: Any, rows: Any, columns: Any, values: Any) -> None:
        """Remembers how far each row of the request pool was written (host pools), so that its
        release is checked against exactly the slots it pointed at."""
        extent = self.row_extent
        if extent is None:
            table = getattr(pool, "req_to_token", None)
            if table is None or getattr(table, "device", None) is None or table.device.type != "cpu":
                return
            extent = self.row_extent = np.zeros(int(table.shape[0]), dtype=np.int64)
            native.set_row_extent(extent)
        if isinstance(rows, int):
            if isinstance(columns, slice):
                stop = columns.stop if columns.stop is not None else (columns.start or 0) + int(values.numel())
            elif hasattr(columns, "numel") and columns.numel():
                stop = int(columns.max()) + 1
            else:
                return
            if 0 <= rows < extent.size and stop > extent[rows]:
                extent[rows] = stop
        elif hasattr(columns, "numel") and columns.numel() == rows.numel():
            r, c = rows.numpy().reshape(-1), columns.numpy().reshape(-1)
            inside = (r >= 0) & (r < extent.size)
            np.maximum.at(extent, r[inside], c[inside] + 1)

    def check_release(self, pool: Any, row: int) -> None:
        """Before a row is given back: the slots it pointed at must be free or the tree's by now."""
        self.paths.note_release(row)
        if self.row_extent is None or not 0 <= row < self.row_extent.size:
            return
        extent = int(self.row_extent[row])
        self.row_extent[row] = 0
        ledger = self.primary
        table = getattr(pool, "req_to_token", None)
        if not extent or ledger is None or table is None or not ledger.xp.sync_free_branching:
            return  # a device ledger is left to the rolling census: reading the row would be a sync
        rid = self.requests.live.get(row, "?")
        slots = table[row, :extent]
        context = self.paths.context(row)
        allocator = self.hosts.get(id(ledger))
        if allocator is not None and group_open(allocator, self.allocator_options(allocator)):
            # The scheduler frees a batch's slots in a group and applies them at the group's end,
            # after it gave back the rows: judge the row then (a copy: the row is reused).
            self.deferred_releases.append((slots.clone(), row, rid, context))
            return
        self._judge_release(ledger, slots, row, rid, context)

    def judge_deferred_releases(self) -> None:
        """At a free group's end, once its frees are in the ledger."""
        ledger = self.primary
        if ledger is None or swa_sides.group_still_open(self, ledger):  # an SWA pool's full part ends its group last
            return
        pending, self.deferred_releases = self.deferred_releases, []
        for slots, row, rid, context in pending:
            self._judge_release(ledger, slots, row, rid, context)

    def _judge_release(self, ledger: SlotLedger, slots: Any, row: int, rid: str, context: dict[str, Any]) -> None:
        self.emit_violations(self.paths.judge_release(ledger, slots, row, rid, context) + swa_sides.released(self, ledger, slots, row, rid))

    def _emit_from_ledger(self, name: str, args: dict[str, Any]) -> None:
        """A ledger's event; a violation flagged inside a path named in violations says so."""
        if name == schema.VIOLATION and self.paths.path:
            args = {**args, **self.paths.during()}
        self.probe.emitter.emit(name, args)

    def emit_violations(self, violations: list[dict[str, Any]]) -> None:
        for violation in violations:
            self.probe.emitter.emit(schema.VIOLATION, violation)

    def allocator_options(self, allocator: Any) -> dict[str, Any]:
        """The map's options for this allocator's class (free-group attributes and the like)."""
        probe_map = self.probe.maps.get("sglang")
        names = {c.__name__ for c in type(allocator).__mro__}
        for spec in probe_map.classes if probe_map is not None else []:
            if spec.kind == "allocator" and spec.cls in names and spec.options:
                return spec.options
        return {}

    # ----- censuses -----

    def request_rows_freed(self) -> None:
        self.last_release_s = time.monotonic()
        if self.requests.idle:
            self.census_pending = True

    def quiet_census_if_due(self) -> None:
        """From the writer thread: the idle census the last release asked for, once the engine has
        stayed idle for QUIET_S (no allocation came to take it)."""
        now = time.monotonic()
        if (
            self.census_pending
            and self.requests.idle
            and now - self.last_release_s >= QUIET_S
            and now - self.last_idle_census >= self.probe.idle_census_interval_s
        ):
            self.census_pending = False
            self.last_idle_census = now
            # quiet: no forward is in flight to free what releases held for one
            self.emit_violations(self.paths.judge_all_held("the engine went quiet with no forward result processed after it"))
            self.census_all("idle")
            self.quiet_census_of_parts()

    def quiet_census_of_parts(self) -> None:
        """A hybrid request pool's Mamba slots (mamba_slots.py, once its hooks met one): judged only here."""
        mamba = self.probe.states.get("mamba_slots")
        if mamba is not None:
            mamba.quiet_census(self)  # type: ignore[attr-defined]

    def census_if_due(self) -> None:
        """Before an allocation: the idle census the last free asked for, if the rate limit allows
        (and, for the first few, the search for the engine's speculative algorithm)."""
        if self.speculative.seeks_left:
            self.judging.seek_engine()
        if not self.census_pending or self.paths.pending:
            return  # (a release held for the forward in flight is judged first)
        self.census_pending = False
        now = time.monotonic()
        if now - self.last_idle_census >= self.probe.idle_census_interval_s:
            self.last_idle_census = now
            self.census_all("idle")

    def census_all(self, reason: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        probe = self.probe
        if not probe.ledger_is_on("slots"):
            return out
        self.judging.judge_ledgers()
        for ledger in list(self.ledgers.values()):
            try:
                out.append(
                    ledger.census(reason=reason, host_free_pages=host_free_pages(self.hosts.get(id(ledger))), tree_sizes=self._tree(ledger))
                )
            except Exception as exc:
                probe.fail("census", exc)
        return out

    def _tree(self, ledger: SlotLedger) -> dict[str, int]:
        tree, swa = self.tree, swa_sides.census_tree_sizes(self, ledger)  # an SWA side's: its SWA holdings
        if tree is None or swa is not None:
            return swa or {}
        try:
            return {"tree_evictable_slots": int(tree.evictable_size()), "tree_protected_slots": int(tree.protected_size())}
        except Exception:
            return {}

    # ----- EngineState -----

    def census_at_shutdown(self, probe: ProbeContext, waited_s: float) -> dict[str, Any] | None:
        """From the writer thread, the launcher waiting: a census once the engine is quiet (no live
        request, no hooked call for a whole round), so it never races the scheduler; None while
        it is not, for up to SHUTDOWN_BUSY_WAIT_S; then the last rolling census, with its age."""
        if not self.ledgers or not probe.ledger_is_on("slots"):
            return {"census": "none", "reason": "no slot ledger"}
        if self.quiet_rounds >= 1:
            started = time.monotonic()
            self.census_pending = False
            self.last_idle_census = started
            self.census_all("shutdown")
            self.quiet_census_of_parts()
            return {"census": "shutdown", "census_s": round(time.monotonic() - started, 3)}
        if waited_s < SHUTDOWN_BUSY_WAIT_S:
            return None
        ages = []
        for ledger in list(self.ledgers.values()):
            rolling = self.rolling.get(id(ledger))
            if rolling is None or rolling.last is None:
                continue
            age_s = round(time.monotonic() - rolling.last_s, 3)
            ages.append(age_s)
            probe.emitter.emit(schema.CENSUS, {**rolling.last, "at_shutdown": True, "age_s": age_s})
        live = len(self.requests.live_rows())
        if not ages:
            return {"census": "none", "reason": f"busy at shutdown ({live} live request(s)) and no rolling census yet"}
        return {"census": "rolling", "age_s": max(ages), "live_requests": live}

    def periodic(self, probe: ProbeContext) -> None:
        if self.ledgers and probe.ledger_is_on("slots"):
            self.judging.judge_ledgers()
        if self.requests.live or self.requests.finished:  # marked once
            probe.mark_serving("a request took a row of the request pool")
        calls = probe.calls
        quiet = self.requests.idle and calls == self._calls_last_round
        self.quiet_rounds = self.quiet_rounds + 1 if quiet else 0
        self._calls_last_round = calls
        if probe.ledger_is_on("slots"):
            self.left_rows.tick(self)
            self.quiet_census_if_due()
        for ledger in list(self.ledgers.values()):
            if not probe.ledger_is_on("slots"):
                break
            try:
                rolling = self.rolling.get(id(ledger))
                if rolling is None:
                    rolling = self.rolling[id(ledger)] = RollingCensus(ledger, self.rolling_interval_s)
                census = rolling.tick(self.requests.live_rows())
                if census is not None:
                    probe.emitter.emit(schema.CENSUS, census)
                ledger.poll()
                if ledger.xp.sync_free_branching:
                    probe.emitter.counter(schema.LEDGER_COUNTER, ledger.counter_args())
                else:
                    counts = ledger.counter_args_async()
                    if counts is not None:
                        probe.emitter.counter(schema.LEDGER_COUNTER, counts)
            except Exception as exc:
                probe.fail("poll", exc)

    def close(self, probe: ProbeContext, reason: str) -> None:
        if self.ledgers and probe.ledger_is_on("slots"):
            self.left_rows.at_exit(self)
            self.census_all(reason)
            for ledger in self.ledgers.values():
                probe.emitter.counter(schema.LEDGER_COUNTER, ledger.counter_args())


def group_open(allocator: Any, options: dict[str, Any]) -> bool:
    """A free group is open on the allocator: its frees are staged and applied at the group's end."""
    attr = options.get("group_attr")
    if not attr:
        return False
    value = getattr(allocator, attr, None)
    if options.get("group_open_when") == "false":
        return value is False
    return value is not None


def sglang_state(probe: ProbeContext) -> SglangState:
    return probe.state("sglang", SglangState)
