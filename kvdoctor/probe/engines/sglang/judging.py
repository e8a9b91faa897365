"""Which of SGLang's slot ledgers may name orphans, judged from the engine objects the probe meets
(the rules themselves: `coverage.py`), and the coverage line that says so.

Held by `SglangState` (`state.judging`): the state keeps the ledgers, this decides and says which
of them judge. Runs only when a ledger or an engine's pools were added since the last judgement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvdoctor.probe.base import objects
from kvdoctor.probe.base.emitter import say
from kvdoctor.probe.engines.sglang import coverage, swa_sides
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext
    from kvdoctor.probe.ledgers.slots import SlotLedger

MAX_LEDGERS_LISTED = 16  # in a coverage line (a bench builds a pool a loop)
MAX_ENGINE_POOLS = 16  # allocators learned from the engine's objects (one per scheduler; a few engines in a test)


class JudgedState(Protocol):
    """What the judge reads of SGLang's per-process state (`state.SglangState`, which holds it)."""

    probe: ProbeContext
    ledgers: dict[int, SlotLedger]
    hosts: dict[int, Any]
    speculative: coverage.SpeculativeRows
    rolling: dict[int, Any]
    rolling_interval_s: float

    def _divert(self) -> None: ...


class CoverageJudge:
    """Decides and says which of one state's ledgers judge orphans, from the engine's pools it met."""

    def __init__(self, state: JudgedState) -> None:
        self.state = state
        # id(allocator) -> (allocator, request pool) as the engine's scheduler, batches or trees name them
        self.engine_pools_by_allocator: dict[int, tuple[Any, Any]] = {}
        self.engine_pools: dict[str, str] = {}  # the last holder's pools by role, for the coverage line
        self.untracked_said = ""  # the pools no ledger counts, as last said on stderr
        self.dirty = False  # a ledger or an engine's pools came since the last judgement
        self.swa_parts: dict[int, Any] = {}  # id(part) -> the SWA pool holding it, once met

    def note_engine(self, holder: Any) -> None:
        """A scheduler, batch or tree: it names an allocator of the engine and the request pool beside it."""
        if self.state.speculative.note(holder):
            self.dirty = True
            self.judge_ledgers(force_report=True)
        allocator = objects.own(holder, "token_to_kv_pool_allocator")
        if allocator is None:
            return
        for part in swa_sides.parts(allocator) or ():
            self.swa_parts.setdefault(id(part), allocator)
        allocator = swa_sides.full_side(allocator)  # an SWA pool's rows and tree name its full part's slots
        requests = objects.own(holder, "req_to_token_pool")
        known = self.engine_pools_by_allocator.get(id(allocator))
        if known is not None and (requests is None or known[1] is requests):
            return  # nothing new
        if known is None and len(self.engine_pools_by_allocator) >= MAX_ENGINE_POOLS:
            return
        self.engine_pools_by_allocator[id(allocator)] = (allocator, requests)
        self.engine_pools = coverage.describe(holder)
        self.dirty = True
        self.judge_ledgers(force_report=True)

    def seek_engine(self) -> None:
        """At an allocation, while the engine's speculative algorithm is not known: its callers."""
        speculative = self.state.speculative
        speculative.seeks_left -= 1
        for holder in coverage.engine_callers(None):
            self.note_engine(holder)
            if speculative.algorithm is not None:
                break
        if speculative.seeks_left <= 0:
            speculative.seeks_left = 0
            self.state._divert()

    def judge_ledgers(self, force_report: bool = False) -> None:
        """Marks each ledger that cannot prove it sees every holder of its slots (once each, said
        with the reason); a coverage line lists the engine's pools and the ledgers' standing. Runs
        only when a ledger or an engine's pools were added since (a bench builds a pool a loop)."""
        if not (self.dirty or force_report):
            return
        self.dirty = False
        classes = {"allocator": self.map_classes("allocator")}
        methods = self.request_methods()
        probe_map = self.state.probe.maps.get("sglang")
        writers = [f"{f.module}.{f.function}" for f in probe_map.functions if f.role == "req_write_spans"] if probe_map else []
        speculative_rows = self.state.speculative.unseen(writers, probe_map.speculative_rows_unhooked if probe_map else [])
        changed = force_report
        open_ledgers = [ledger for ledger in self.state.ledgers.values() if not ledger.not_judged]
        pending = {id(self.state.hosts.get(id(ledger))) for ledger in open_ledgers}
        composites: dict[int, Any] = {}  # id(allocator) -> the allocator that holds it as a part
        for other in [*self.state.hosts.values(), *(pair[0] for pair in self.engine_pools_by_allocator.values())]:
            for value in coverage.values(other):
                if id(value) in pending and value is not other:
                    composites.setdefault(id(value), other)
        for ledger in open_ledgers:
            allocator = self.state.hosts.get(id(ledger))
            holder = composites.get(id(allocator)) or self.swa_composite(allocator)
            requests = self.engine_pools_by_allocator.get(id(allocator), (None, None))[1]
            side = self.swa_side(ledger, allocator, holder)
            if side is not None and holder is not None:  # a side of an SWA pool: one pool, with its full part's request pool
                holder, requests = None, self.engine_pools_by_allocator.get(id(swa_sides.full_side(holder)), (None, None))[1]
            prefill_rows = coverage.prefill_rows_unseen(requests, probe_map.prefill_rows_unhooked if probe_map else "")
            reason = side or coverage.why_not_judged(allocator, holder, requests, classes, methods, speculative_rows, prefill_rows)
            if reason:
                ledger.not_judged = reason
                changed = True
                say(f"{ledger.name}: orphans not judged: {reason}")
        if not changed:
            return
        not_judged = {ledger.name: ledger.not_judged for ledger in self.state.ledgers.values() if ledger.not_judged}
        total = len(self.state.ledgers)
        pools = [pair[1] for pair in list(self.engine_pools_by_allocator.values()) if pair[1] is not None]
        mamba_off = getattr(self.state.probe.states.get("mamba_slots"), "off", "")
        mamba = coverage.mamba_judged(pools[-1] if pools else None, mamba_off)
        unseen = coverage.untracked(self.engine_pools, mamba)
        reason = f"coverage: {total - len(not_judged)} of {total} slot ledger(s) judge orphans" + (
            "; not judged: " + "; ".join(f"{name}: {text}" for name, text in list(not_judged.items())[:MAX_LEDGERS_LISTED])
            if not_judged
            else ""
        )
        if unseen:
            uncounted = ", ".join(f"{kind} ({role})" for role, kind in unseen.items())
            reason += f"; not counted by any ledger (their slots are neither tracked nor judged): {uncounted}"
            if uncounted != self.untracked_said:
                self.untracked_said = uncounted
                say(f"pools kvdoctor does not count (their slots are neither tracked nor judged): {uncounted}")
        if mamba and self.engine_pools.get(coverage.MAMBA_PARTS[1]):
            reason += f"; {self.engine_pools[coverage.MAMBA_PARTS[1]]} (req_to_token_pool.mamba_allocator): judged when the engine is quiet"
        composite_standing = self.composites_judged()
        if composite_standing:
            reason += "; " + "; ".join(f"{name}: {text}" for name, text in composite_standing.items())
        listed = list(self.state.ledgers.values())[-MAX_LEDGERS_LISTED:]
        self.state.probe.emitter.emit(
            schema.PROBE_STATUS,
            {
                "component": "coverage",
                "state": "partial" if not_judged or unseen else "on",
                "reason": reason,
                "ledgers": {ledger.name: ledger.not_judged or "judged" for ledger in listed},
                "not_judged_ledgers": len(not_judged),
                "engine_pools": self.engine_pools,
                "composites": composite_standing,
                "untracked_pools": unseen,
                "speculative": self.state.speculative.algorithm or "",
                "speculative_row_writers": writers,
            },
        )

    def swa_composite(self, allocator: Any) -> Any:
        """The SWA pool `allocator` is a part of: as met (an engine object named it, or a call of it
        reached the part), else None."""
        found = self.swa_parts.get(id(allocator))
        if found is None and len(self.swa_parts) < 2 * MAX_ENGINE_POOLS:
            found = swa_sides.composite_in_callers(allocator)
            for part in swa_sides.parts(found) or ():
                self.swa_parts.setdefault(id(part), found)
        return found

    def swa_side(self, ledger: SlotLedger, allocator: Any, holder: Any) -> str | None:
        """None where `allocator` is no part of an SWA pool; '' for a side judged (its ledger put
        in the pool's books), else why the side is not. An SWA part whose pool was not found is
        not judged: its rows never name its slots."""
        if swa_sides.parts(holder) is None:
            if holder is None and not swa_sides.may_be_primary(ledger.name):
                return "an SWA part of a sliding-window pool the probe did not find"
            return None
        why = swa_sides.standing(holder)
        if why:
            return f"a part of {swa_sides.SWA_CLASS}, not judged: {why}"
        if not swa_sides.install(self.state, holder, ledger, allocator):
            return f"more than {swa_sides.MAX_COMPOSITES} {swa_sides.SWA_CLASS} pools in one process"
        return ""

    def composites_judged(self) -> dict[str, str]:
        """Each SWA pool met and its standing, for the coverage line."""
        out: dict[str, str] = {}
        for side in swa_sides.sides(self.state.probe).sides.values():
            full, swa = side.full, side.swa
            if full is not None and swa is not None and not full.not_judged and not swa.not_judged:
                out[swa_sides.SWA_CLASS] = (
                    f"judged as one pool: {full.name} (its full side) and {swa.name} (its SWA side, whose holders are read "
                    "from SGLang at idle and exit censuses and checked at each release)"
                )
        return out

    def request_methods(self) -> dict[str, list[str]]:
        probe_map = self.state.probe.maps.get("sglang")
        return {c.cls: list(c.methods) for c in probe_map.classes if c.kind == "requests"} if probe_map is not None else {}

    def map_classes(self, kind: str) -> set[str]:
        probe_map = self.state.probe.maps.get("sglang")
        return {c.cls for c in probe_map.classes if c.kind == kind} if probe_map is not None else set()

    def request_index_attr(self) -> str:
        probe_map = self.state.probe.maps.get("sglang")
        for spec in probe_map.classes if probe_map is not None else []:
            if spec.kind == "requests":
                return str(spec.options.get("req_index_attr", "req_pool_idx"))
        return "req_pool_idx"
