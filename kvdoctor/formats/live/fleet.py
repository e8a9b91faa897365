"""The probed processes' ledgers as Prometheus metrics: `kvdoctor run --metrics` and `attach --metrics`.

One server per run, in the `kvdoctor run` (or `attach`) process, fed by the probes. Every probe
already appends its ledger counters, censuses, violations and health to the run's trace from its
own writer thread; a thread here follows that trace (complete lines only, `TraceTail`) and keeps
the latest value of each series, and a scrape reads those values under a lock. Nothing is added
inside the probed processes: nothing on the scheduler's thread, nothing per hooked call.

Series (all gauges but the `_total` counters), each with the labels engine, version, pid, title
(the process title, secrets redacted) and rank (`tp1`, `dp0/tp1`, ... where the engine names one):

    kvdoctor_kv_slots{pool,state}                   the ledger's slots: free, owned, tree, ... (kv_slots counters)
    kvdoctor_census_orphan_slots{pool}              orphans at the latest census
    kvdoctor_census_orphan_before_attach_slots{pool} of those, leaked before the probe attached
    kvdoctor_census_orphan_streak{pool}             censuses in a row that found orphans
    kvdoctor_censuses_total{pool}                   censuses taken
    kvdoctor_census_age_seconds{pool}               since the latest census (read at scrape)
    kvdoctor_violations_total{pool,kind}            ledger rules broken, by kind
    kvdoctor_violation_slots_total{pool,kind}       the slots they named
    kvdoctor_probe_health{health}                   1 for the probe's health now: on, partial or off
    kvdoctor_probe_part_stopped{part}               1 for each part (memory classes, attribution, ...) that stopped alone
    kvdoctor_memory_bytes{class}                    memory by class: the sampler's (rss, anon, ...) and the probe's split
    kvdoctor_memory_limit_bytes                     the memory the process may use (cgroup or machine)
    kvdoctor_hicache{field}, kvdoctor_l3_store{field}  HiCache's host pool and L3 store counters, where the probe has them

Bounded cardinality: at most MAX_PROCESSES processes (the first seen), MAX_POOLS pools and
MAX_FIELDS HiCache/L3 fields and MAX_PARTS probe parts each; violation kinds outside the schema's
are counted as `other`; titles are cut to TITLE_LIMIT characters. SERIES_BOUND is the most
series a scrape can return; processes left out are counted in `kvdoctor_metrics_processes_left_out`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvdoctor.formats.live.prometheus import label_safe
from kvdoctor.probe.base.rank import rank_of
from kvdoctor.trace import schema
from kvdoctor.trace.writer import redact
from kvdoctor.units import finite_number, short_title

MAX_PROCESSES = 64
MAX_POOLS = 16
MAX_FIELDS = 32
MAX_PARTS = 16
TITLE_LIMIT = 120
SLOT_STATES = ("total", "free", "owned", "tree", "tree_freed", "unaccounted", "orphan", "connector_held")
VIOLATION_KINDS = tuple(
    dict.fromkeys((*schema.VIOLATION_KINDS, schema.ORPHAN_SLOTS, schema.TREE_HOLDS_FREE_SLOT, schema.GRAPH_REPLAY_DURING_LOAD, "other"))
)
HEALTH_STATES = ("on", "partial", "off")
WHOLE_PROBE = frozenset({"ledger", "attach"})  # a component whose stopping is the whole probe's
SAMPLER_CLASSES = {"rss_bytes": "rss", "anon_bytes": "anon", "shmem_bytes": "shmem", "file_bytes": "file", "swap_bytes": "swap"}
SAMPLER_CLASSES |= {"pinned_bytes": "pinned", "gpu_bytes": "gpu"}
PROBE_CLASSES = {
    "malloc_heap_bytes": "malloc_heap",
    "python_heap_bytes": "python_heap",
    "native_unexplained_bytes": "native_unexplained",
    "pinned_cache_bytes": "pinned_cache",
}
POOL_SERIES = len(SLOT_STATES) + 5 + 2 * len(VIOLATION_KINDS)  # slot states, the census's five, violations and their slots
PROCESS_SERIES = len(HEALTH_STATES) + MAX_PARTS + len(SAMPLER_CLASSES) + len(PROBE_CLASSES) + 1 + 2 * MAX_FIELDS
SERIES_BOUND = MAX_PROCESSES * (PROCESS_SERIES + MAX_POOLS * POOL_SERIES) + 1
PROCESS_LABELS = ("engine", "version", "pid", "title", "rank")


@dataclass
class _Pool:
    slots: dict[str, float] = field(default_factory=dict)
    orphan_slots: float | None = None
    orphan_before_attach_slots: float = 0.0
    orphan_streak: int = 0
    censuses: int = 0
    last_census_s: float = 0.0
    violations: dict[str, int] = field(default_factory=dict)
    violation_slots: dict[str, int] = field(default_factory=dict)


@dataclass
class _Process:
    engine: str = ""
    version: str = ""
    title: str = ""
    rank: str = ""
    probed: bool = False
    health: str = "on"
    parts_stopped: set[str] = field(default_factory=set)
    memory: dict[str, float] = field(default_factory=dict)
    memory_limit: float | None = None
    hicache: dict[str, float] = field(default_factory=dict)
    l3: dict[str, float] = field(default_factory=dict)
    pools: dict[str, _Pool] = field(default_factory=dict)


def split_pool(allocator: str) -> tuple[str, str]:
    """`tp1/swa/TokenToKVPoolAllocator#1` -> ('tp1', 'swa/TokenToKVPoolAllocator#1'): the rank the
    ledger's name starts with, and the pool's name alike on every rank."""
    parts = allocator.split("/")
    rank = []
    while len(parts) > 1 and rank_of("x::" + parts[0].upper()) == parts[0]:
        rank.append(parts.pop(0))
    return "/".join(rank), "/".join(parts)


class FleetState:
    """The latest value of every series, fed from the trace by one thread, read by scrapes."""

    def __init__(self, clock: Any = time.time) -> None:
        self._lock = threading.Lock()
        self._processes: dict[int, _Process] = {}
        self._left_out: set[int] = set()
        self._clock = clock

    def _process(self, pid: int) -> _Process | None:
        found = self._processes.get(pid)
        if found is None:
            if len(self._processes) >= MAX_PROCESSES:
                if len(self._left_out) < 1 << 16:
                    self._left_out.add(pid)
                return None
            found = self._processes[pid] = _Process()
        return found

    @staticmethod
    def _pool(process: _Process, allocator: Any) -> _Pool | None:
        rank, name = split_pool(str(allocator or ""))
        if rank and not process.rank:
            process.rank = rank
        pool = process.pools.get(name)
        if pool is None and len(process.pools) < MAX_POOLS:
            pool = process.pools[name] = _Pool()
        return pool

    def feed(self, events: Iterable[schema.Event]) -> None:
        with self._lock:
            for event in events:
                if event.name == schema.RUN_HEADER or event.name == schema.TRACE_END:
                    continue
                process = self._process(event.pid)
                if process is not None:
                    self._feed_one(process, event)

    def _feed_one(self, process: _Process, event: schema.Event) -> None:
        args = event.args if isinstance(event.args, dict) else {}
        name = event.name
        if name == schema.HEADER:
            probed = event.cat == schema.CAT_PROBE
            if probed or not process.engine:
                process.engine = str(args.get("engine") or process.engine)[:32]
                process.version = str(args.get("engine_version") or process.version)[:32]
            process.probed = process.probed or probed
            self._title(process, args.get("process_title"))
            limit = finite_number(args.get("memory_limit_bytes"))
            if limit is not None:
                process.memory_limit = limit
        elif name == schema.MEMORY_COUNTER:
            self._title(process, args.get("title"))
            self._numbers(process.memory, args, SAMPLER_CLASSES)
        elif name == schema.MEMORY_CLASSES:
            self._numbers(process.memory, args, PROBE_CLASSES)
        elif name == schema.LEDGER_COUNTER:
            pool = self._pool(process, args.get("allocator"))
            if pool is not None:
                for state in SLOT_STATES:
                    value = finite_number(args.get(state + "_slots"))
                    if value is not None:
                        pool.slots[state] = value
        elif name == schema.CENSUS:
            self._census(process, args, event.ts)
        elif name == schema.VIOLATION:
            pool = self._pool(process, args.get("allocator"))
            if pool is not None:
                kind = str(args.get("kind"))
                kind = kind if kind in VIOLATION_KINDS else "other"
                pool.violations[kind] = pool.violations.get(kind, 0) + 1
                count = finite_number(args.get("count"))
                pool.violation_slots[kind] = pool.violation_slots.get(kind, 0) + int(max(0.0, count or 0.0))
        elif name == schema.PROBE_STATUS:
            self._status(process, args)
        elif name in (schema.HICACHE_COUNTER, schema.L3_COUNTER):
            table = process.hicache if name == schema.HICACHE_COUNTER else process.l3
            for key, raw in args.items():
                value = finite_number(raw)
                if value is not None and not isinstance(raw, bool) and (key in table or len(table) < MAX_FIELDS):
                    table[str(key)[:64]] = value

    def _title(self, process: _Process, title: Any) -> None:
        if isinstance(title, str) and title:
            process.title = short_title(redact(title), TITLE_LIMIT)
            process.rank = rank_of(title) or process.rank

    @staticmethod
    def _numbers(memory: dict[str, float], args: dict[str, Any], classes: dict[str, str]) -> None:
        for arg, memory_class in classes.items():
            value = finite_number(args.get(arg))
            if value is not None:
                memory[memory_class] = value

    def _census(self, process: _Process, args: dict[str, Any], ts: float) -> None:
        pool = self._pool(process, args.get("allocator"))
        if pool is None:
            return
        pool.censuses += 1
        pool.last_census_s = ts / 1e6
        orphans = finite_number(args.get("orphan_slots"))
        if orphans is not None:
            pool.orphan_slots = orphans
            pool.slots["orphan"] = orphans
            pool.orphan_streak = pool.orphan_streak + 1 if orphans > 0 else 0
        pool.orphan_before_attach_slots = finite_number(args.get("orphan_before_attach_slots")) or 0.0

    @staticmethod
    def _status(process: _Process, args: dict[str, Any]) -> None:
        state = str(args.get("state"))
        component = str(args.get("component") or "ledger")
        if component in WHOLE_PROBE:
            if state == "off":
                process.health = "off"
            elif state == "partial" and process.health == "on":
                process.health = "partial"
        elif state in ("off", "partial") and (component in process.parts_stopped or len(process.parts_stopped) < MAX_PARTS):
            process.parts_stopped.add(component[:64])
            if process.health == "on":
                process.health = "partial"

    def families(self) -> Iterator[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """(name, type, help, [(labels, value)]) for every family, in a stable order."""
        now = self._clock()
        with self._lock:
            rows: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name, _, _ in FAMILIES}
            for pid, process in sorted(self._processes.items()):
                base = {"engine": process.engine, "version": process.version, "pid": str(pid), "title": process.title, "rank": process.rank}
                for memory_class, value in sorted(process.memory.items()):
                    rows["kvdoctor_memory_bytes"].append(({**base, "class": memory_class}, value))
                if process.memory_limit is not None:
                    rows["kvdoctor_memory_limit_bytes"].append((base, process.memory_limit))
                if process.probed:
                    for health in HEALTH_STATES:
                        rows["kvdoctor_probe_health"].append(({**base, "health": health}, float(health == process.health)))
                    for part in sorted(process.parts_stopped):
                        rows["kvdoctor_probe_part_stopped"].append(({**base, "part": part}, 1.0))
                for key, value in sorted(process.hicache.items()):
                    rows["kvdoctor_hicache"].append(({**base, "field": key}, value))
                for key, value in sorted(process.l3.items()):
                    rows["kvdoctor_l3_store"].append(({**base, "field": key}, value))
                for name, pool in sorted(process.pools.items()):
                    self._pool_rows(rows, {**base, "pool": name}, pool, now)
            left_out = float(len(self._left_out))
        rows["kvdoctor_metrics_processes_left_out"].append(({}, left_out))
        for name, kind, help_text in FAMILIES:
            yield name, kind, help_text, label_safe(rows[name])  # a lone surrogate in a title never fails a scrape

    @staticmethod
    def _pool_rows(rows: dict[str, list[tuple[dict[str, str], float]]], labels: dict[str, str], pool: _Pool, now: float) -> None:
        for state, value in sorted(pool.slots.items()):
            rows["kvdoctor_kv_slots"].append(({**labels, "state": state}, value))
        if pool.censuses:
            rows["kvdoctor_censuses"].append((labels, float(pool.censuses)))
            rows["kvdoctor_census_age_seconds"].append((labels, max(0.0, now - pool.last_census_s)))
        if pool.orphan_slots is not None:
            rows["kvdoctor_census_orphan_slots"].append((labels, pool.orphan_slots))
            rows["kvdoctor_census_orphan_before_attach_slots"].append((labels, pool.orphan_before_attach_slots))
            rows["kvdoctor_census_orphan_streak"].append((labels, float(pool.orphan_streak)))
        for kind, count in sorted(pool.violations.items()):
            rows["kvdoctor_violations"].append(({**labels, "kind": kind}, float(count)))
            rows["kvdoctor_violation_slots"].append(({**labels, "kind": kind}, float(pool.violation_slots.get(kind, 0))))


FAMILIES = (
    ("kvdoctor_kv_slots", "gauge", "KV slots of one pool by ledger state (total, free, owned, tree, orphan, ...)."),
    ("kvdoctor_census_orphan_slots", "gauge", "KV slots orphaned (neither free, in the tree nor owned) at the latest census."),
    ("kvdoctor_census_orphan_before_attach_slots", "gauge", "Of the orphans at the latest census, those leaked before the probe attached."),
    ("kvdoctor_census_orphan_streak", "gauge", "Censuses in a row that found orphaned slots (0 once one finds none)."),
    ("kvdoctor_censuses", "counter", "Censuses of one pool taken so far."),
    ("kvdoctor_census_age_seconds", "gauge", "Seconds since the latest census of one pool."),
    ("kvdoctor_violations", "counter", "Ledger rules broken at hooked calls, by kind (double_free, stale_last_loc, ...)."),
    ("kvdoctor_violation_slots", "counter", "KV slots named by ledger rules broken, by kind."),
    ("kvdoctor_probe_health", "gauge", "1 for the probe's health in a process now (on, partial, off), 0 for the others."),
    ("kvdoctor_probe_part_stopped", "gauge", "1 for each part of the probe that stopped alone (the ledgers go on)."),
    ("kvdoctor_memory_bytes", "gauge", "Memory of one process by class, in bytes: the sampler's and the probe's split of anon."),
    ("kvdoctor_memory_limit_bytes", "gauge", "The memory one process may use (its cgroup's limit, else the machine's), in bytes."),
    ("kvdoctor_hicache", "gauge", "HiCache host pool and controller counters (slots, queue depths, bytes), by field."),
    ("kvdoctor_l3_store", "gauge", "HiCache L3 store counters (pages and keys written and read, bytes), by field."),
    ("kvdoctor_metrics_processes_left_out", "gauge", f"Processes not exported: past the first {MAX_PROCESSES}."),
)
