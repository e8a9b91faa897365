"""Runs every detector over one event stream, live or recorded, and collects the findings.

`Analyzer` takes one event at a time (a watch feeds it as it samples), `analyze` feeds it a whole
stream, and `analyze_trace` (kvdoctor.analysis.replay) streams a recorded trace through it: all
three end in the same `Analysis`, so a live watch and a replay of its trace make the same findings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from kvdoctor.analysis.admission import COUNTED, MAX_PROCESSES, Admission, level_of
from kvdoctor.analysis.causes import ordered
from kvdoctor.analysis.detectors import all_detectors
from kvdoctor.analysis.detectors.base import Detector, Sink, reads
from kvdoctor.analysis.findings import ERROR, INFO, WARNING, Finding
from kvdoctor.analysis.growth import GrowthParams
from kvdoctor.analysis.named import bounded_args
from kvdoctor.analysis.record import ProbeRecord
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK
from kvdoctor.trace import schema
from kvdoctor.trace.counter_block import CounterBlock
from kvdoctor.units import BoundedSeries

__all__ = ["MAX_PROCESSES", "Analysis", "Analyzer", "REPORT_SCHEMA_ID", "all_detectors", "analyze", "exit_code_for"]

REPORT_SCHEMA_NAME = "kvdoctor.report"
REPORT_SCHEMA_VERSION = 1
REPORT_SCHEMA_ID = f"{REPORT_SCHEMA_NAME}/{REPORT_SCHEMA_VERSION}"  # the JSON report, not the trace

SEVERITY_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}
LEDGERS_NAMED = 64  # damaged or unjudged ledgers named apiece; the rest is counted

D = TypeVar("D")
_HEADERS = (schema.HEADER, schema.RUN_HEADER)
_NAMING = frozenset({schema.CENSUS, schema.VIOLATION})  # the events whose tables name requests and sites
READ_BY_ANALYZER = frozenset({*_HEADERS, schema.PROCESS_NAME, schema.PROBE_STATUS, schema.CENSUS, schema.TRACE_END})  # besides its sinks


@dataclasses.dataclass
class Analysis:
    """A finished analysis: what reporters render. Knows nothing of how it was made."""

    findings: list[Finding]
    processes: dict[int, dict[str, Any]]
    events: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    source: str = ""
    series: dict[str, Any] = dataclasses.field(default_factory=dict)
    censuses: int = 0  # how many times a ledger was counted whole: 0 means no orphan verdict exists
    last_censuses: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # pid -> its last census (ts, reason, age_s)
    end_ts_us: float | None = None  # when the run ended (the trace's end event), if it says
    command_exit: int | None = None  # the exit status of the command `run`/`gate` ran, if the trace says
    damaged_censuses: dict[str, str] = dataclasses.field(default_factory=dict)  # "pid N ledger" -> what is wrong with a census
    not_judged: dict[str, str] = dataclasses.field(default_factory=dict)  # "pid N ledger" -> why its censuses give no verdict
    unanalysed_verdict_events: int = 0  # censuses and broken rules of processes beyond MAX_PROCESSES: findings there are unknown
    stopped_early: dict[int, str] = dataclasses.field(default_factory=dict)  # pid -> why its probe's record ends before the run
    uncounted_ledgers: dict[str, str] = dataclasses.field(default_factory=dict)  # "pid N ledger" -> held slots, never counted
    unheaded_pids: list[int] = dataclasses.field(default_factory=list)  # wrote probe events, no readable probe header
    damaged_lines: int = 0  # lines of the trace that could not be read (not the cut last one)
    outlived: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {pid, title} that outlived `run`'s command
    growth_evidence: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # per pid and memory class (growth_verdict)
    growth_budget_bytes_per_s: float | None = None  # what the growth verdicts of watch and replay are judged against
    end_events: int = 0  # the trace's end events: 0 when the run was killed or is still running
    probe_path_lost: list[dict[str, Any]] = dataclasses.field(
        default_factory=list
    )  # {pid, title, lost}: Python processes `run` saw lose its PYTHONPATH (or environment)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": REPORT_SCHEMA_ID,
            "source": self.source,
            "events": self.events,
            "findings": [f.to_dict() for f in self.findings],
            "processes": {str(pid): info for pid, info in self.processes.items()},
            "censuses": self.censuses,
            "last_censuses": {str(pid): info for pid, info in self.last_censuses.items()},
            "not_judged": self.not_judged,
            "unanalysed_verdict_events": self.unanalysed_verdict_events,
            "stopped_early": {str(pid): why for pid, why in self.stopped_early.items()},
            "uncounted_ledgers": self.uncounted_ledgers,
            "unheaded_pids": self.unheaded_pids,
            "outlived": self.outlived,
            "probe_path_lost": self.probe_path_lost,
            "notes": self.notes,
        }


def _numbers(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in args.items() if isinstance(v, (int, float))}


MAX_OUTLIVED = 16


def _engine_from_map(processes: dict[int, dict[str, Any]], event: schema.Event) -> None:
    """A probe that started before its engine was imported (`run --attribution` starts it first)
    wrote its header with no engine; the ledger's map it chose later ("sglang-0.5.23.toml") names it."""
    info = processes.get(event.pid)
    if info is None or info.get("engine") or not info.get("probe"):
        return
    engine = str(event.args["map"]).split("-", 1)[0]
    if engine in schema.SERVING_ENGINES:
        info["engine"] = engine


def _outlived(value: Any) -> list[dict[str, Any]]:
    """The processes `run` saw outlive its command, as its end event lists them (bounded, typed)."""
    out = []
    for item in value[:MAX_OUTLIVED] if isinstance(value, list) else []:
        pid = item.get("pid") if isinstance(item, dict) else None
        if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
            out.append({"pid": pid, "title": str(item.get("title") or "")[:120]})
    return out


def _path_lost(value: Any) -> list[dict[str, Any]]:
    """The Python processes whose PYTHONPATH (or environment) lost what `run` set for the probe, as its end event lists them."""
    items = [item for item in value if isinstance(item, dict) and isinstance(item.get("pid"), int)] if isinstance(value, list) else []
    lost = {item["pid"]: str(item.get("lost") or "")[:20] for item in items}
    return [{**p, "lost": lost[p["pid"]]} for p in _outlived(items)]


class SeriesCollector:
    """Keeps the counters reporters plot (ledger sizes, memory), thinned to a bounded size, for at
    most MAX_SERIES of each counter (the first met): a trace naming 400k allocators costs no more
    than one naming 128, and the rest is counted for the notes."""

    consumes = frozenset({schema.LEDGER_COUNTER, schema.MEMORY_COUNTER, schema.HICACHE_COUNTER})
    counter_state_apart = False

    MAX_POINTS = 3999
    MAX_SERIES = 128  # per counter name (kv_slots, memory, hicache)
    MAX_LABELS_COUNTED = 1 << 18  # distinct labels left out, counted exactly up to this many

    def __init__(self) -> None:
        self._series: dict[str, BoundedSeries[dict[str, float]]] = {}
        self._kept: dict[str, int] = {}  # counter name -> series kept
        self._left_labels: dict[str, set[int]] = {}  # counter name -> hashes of the labels left out
        self._left_events: dict[str, int] = {}

    def _series_for(self, name: str, label: str, events: int) -> BoundedSeries[dict[str, float]] | None:
        series = self._series.get(label)
        if series is not None:
            return series
        if self._kept.get(name, 0) >= self.MAX_SERIES:
            left = self._left_labels.setdefault(name, set())
            if len(left) < self.MAX_LABELS_COUNTED:
                left.add(hash(label))
            self._left_events[name] = self._left_events.get(name, 0) + events
            return None
        self._kept[name] = self._kept.get(name, 0) + 1
        series = self._series[label] = BoundedSeries(self.MAX_POINTS)
        return series

    def feed(self, event: schema.Event) -> None:
        if event.ph != "C":
            return
        series = self._series_for(event.name, f"{event.name}:{event.pid}:{event.args.get('allocator', '')}", 1)
        if series is not None:
            series.add(event.ts, _numbers(event.args))

    def feed_counter_block(self, block: CounterBlock) -> None:
        """`feed` for each line of the block; only the points the series keeps are parsed."""
        series = self._series_for(block.name, f"{block.name}:{block.pid}:{block.allocator}", len(block))
        if series is None:
            return

        def points_at(indices: list[int]) -> list[tuple[float, dict[str, float]]]:
            return [(event.ts, _numbers(event.args)) for event in block.events(indices)]

        series.add_from(len(block), points_at)

    def forget(self, pid: int) -> None:
        """Drops the series of a process the analysis set aside (kvdoctor.analysis.admission)."""
        for label in [label for label in self._series if label.split(":", 2)[1] == str(pid)]:
            del self._series[label]
            name = label.split(":", 1)[0]
            self._kept[name] -= 1

    def notes(self) -> list[str]:
        out = []
        for name, labels in sorted(self._left_labels.items()):
            many = f"at least {len(labels)}" if len(labels) >= self.MAX_LABELS_COUNTED else str(len(labels))
            out.append(
                f"the trace has more {name} series than one analysis keeps: {self.MAX_SERIES} are kept for the plots, "
                f"{many} more ({self._left_events[name]} event(s)) are not plotted"
            )
        return out

    @property
    def series(self) -> dict[str, dict[str, Any]]:
        """{"<event name>:<pid>:<allocator>": {"ts_us": [...], "values": [{arg: number}], "stride": n}}."""
        return {label: {"ts_us": list(s.times), "values": list(s.values), "stride": s.stride} for label, s in self._series.items()}


class Analyzer:
    """Feeds each event only to the detectors that read its name (a detector without a
    `consumes` set sees everything), so large traces replay at streaming speed."""

    def __init__(
        self,
        *,
        source: str = "",
        detectors: list[Detector] | None = None,
        growth_params: GrowthParams | None = None,
        host_memory_limit_bytes: int | None = None,
    ) -> None:
        self.source = source
        self.detectors = (
            detectors
            if detectors is not None
            else all_detectors(growth_params=growth_params, host_memory_limit_bytes=host_memory_limit_bytes)
        )
        self.processes: dict[int, dict[str, Any]] = {}
        self.events = 0
        self._series = SeriesCollector()
        self._record = ProbeRecord()
        self.sinks: tuple[Sink, ...] = (self._series, self._record, *self.detectors)
        self._routes: dict[str, list[Callable[[schema.Event], None]]] = {}
        self.admission = Admission(self._forget)  # which processes' events are analysed
        self.censuses = 0
        self.last_censuses: dict[int, dict[str, Any]] = {}
        self.not_judged: dict[str, str] = {}
        self.end_ts_us: float | None = None
        self.command_exit: int | None = None
        self.outlived: list[dict[str, Any]] = []
        self.end_events = 0
        self.probe_path_lost: list[dict[str, Any]] = []
        self.damaged_censuses: dict[str, str] = {}
        self._unnamed_ledgers = [0, 0]  # censuses of ledgers not named: [not judged, damaged]

    def feed(self, event: schema.Event) -> None:
        self.feed_all((event,))

    def feed_all(self, events: Iterable[schema.Event]) -> None:
        """The hot loop of every replay: the sinks of an event name are looked up once."""
        routes, processes, sinks = self._routes, self.processes, self.sinks
        levels, take = self.admission.levels, self.admission.take
        count = 0
        for event in events:
            count += 1
            name = event.name
            known = levels.get(event.pid)
            if (known is None or known < COUNTED) and name != schema.TRACE_END and not take(event.pid, level_of(name, event.args)):
                continue  # the trace's end is the whole trace's, whichever process wrote it
            if name in _NAMING:  # a table of a million request ids is cut to its largest before any sink keeps it
                event.args = bounded_args(event.args)
            feeds = routes.get(name)
            if feeds is None:
                feeds = routes[name] = [s.feed for s in sinks if reads(s, name)]
            if name in _HEADERS:
                info = processes.setdefault(event.pid, {})
                info.update({k: str(event.args[k]) for k in ("engine", "engine_version", "process_title", "probe") if event.args.get(k)})
            elif name == schema.PROBE_STATUS and event.args.get("map"):
                _engine_from_map(processes, event)
            elif name == schema.PROCESS_NAME and event.args.get("name"):
                processes.setdefault(event.pid, {})["process_title"] = str(event.args["name"])
            elif name == schema.CENSUS:
                args = event.args
                if not schema.census_is_readable(args):
                    self._name_ledger(
                        self.damaged_censuses, event, f"its orphan count is unreadable ({str(args.get('orphan_slots'))[:40]!r})"
                    )
                elif args.get("judged") is False:
                    self._name_ledger(self.not_judged, event, str(args.get("not_judged", ""))[:400])
                else:
                    self.censuses += 1
                    self.last_censuses[event.pid] = {"ts_us": event.ts, "reason": str(args.get("reason", "")), "age_s": args.get("age_s")}
            elif name == schema.TRACE_END:
                self.end_events += 1
                self.end_ts_us = float(event.args.get("ended_at_us") or event.ts or 0) or None
                code = event.args.get("command_exit")
                if isinstance(code, int) and not isinstance(code, bool):
                    self.command_exit = code
                self.outlived = _outlived(event.args.get("outlived"))
                self.probe_path_lost = _path_lost(event.args.get("probe_path_lost"))
                self._record.stopped_writing(event.args.get("writers_stopped"))
            for feed in feeds:
                feed(event)
        self.events += count

    def _name_ledger(self, table: dict[str, str], event: schema.Event, why: str) -> None:
        """`table`["pid N allocator"] = why, for at most LEDGERS_NAMED ledgers; the rest counted."""
        where = f"pid {event.pid} {str(event.args.get('allocator', ''))[:200]}".rstrip()
        if where in table or len(table) < LEDGERS_NAMED:
            table[where] = why
        else:
            self._unnamed_ledgers[table is self.damaged_censuses] += 1

    def _forget(self, pid: int) -> None:
        """A process set aside to make room for one that tells more: every sink drops it."""
        self.processes.pop(pid, None)
        for sink in self.sinks:
            forget = getattr(sink, "forget", None)
            if forget is not None:
                forget(pid)

    def detector(self, kind: type[D]) -> D | None:
        """The detector of this class, for views that read its state as it goes (the live table)."""
        return next((d for d in self.detectors if isinstance(d, kind)), None)

    def findings(self) -> list[Finding]:
        """The findings as they stand now: errors first, causes before their consequences (kvdoctor.analysis.causes)."""
        findings: list[Finding] = []
        for detector in self.detectors:
            findings.extend(detector.findings())
        return ordered(findings)

    def finish(self, notes: Iterable[str] = (), *, damaged_lines: int = 0) -> Analysis:
        notes = [*notes, *self.admission.notes(), *self._series.notes()]
        for count, what in zip(self._unnamed_ledgers, ("not judged", "damaged"), strict=True):
            if count:
                notes.append(f"{count} more census(es) of ledgers {what} are not named one by one (the first {LEDGERS_NAMED} are)")
        for pid, error in sorted(self._record.said_by_run.items()):
            notes.append(f"pid {pid} stopped writing its trace ({error}): what it did after that is not in the trace")
        return Analysis(
            findings=self.findings(),
            processes=self.processes,
            events=self.events,
            notes=notes,
            source=self.source,
            series=self._series.series,
            censuses=self.censuses,
            last_censuses=self.last_censuses,
            end_ts_us=self.end_ts_us,
            command_exit=self.command_exit,
            damaged_censuses=self.damaged_censuses,
            not_judged=self.not_judged,
            unanalysed_verdict_events=self.admission.not_analysed[COUNTED],
            stopped_early=self._record.stopped_early(),
            uncounted_ledgers=self._record.uncounted(),
            unheaded_pids=self._record.unheaded(self.processes),
            damaged_lines=damaged_lines,
            outlived=self.outlived,
            probe_path_lost=self.probe_path_lost,
            growth_evidence=[v for d in self.detectors for v in getattr(d, "growth_verdicts", list)()],
            growth_budget_bytes_per_s=self._growth_budget(),
            end_events=self.end_events,
        )

    def _growth_budget(self) -> float | None:
        params = next((p for p in (getattr(d, "params", None) for d in self.detectors) if isinstance(p, GrowthParams)), None)
        if params is None:
            return None
        return params.budget_bytes_per_s if params.budget_bytes_per_s is not None else params.min_rate_bytes_per_s


def analyze(
    events: Iterable[schema.Event], *, source: str = "", detectors: list[Detector] | None = None, host_memory_limit_bytes: int | None = None
) -> Analysis:
    """Every event of a stream through one `Analyzer`."""
    analyzer = Analyzer(source=source, detectors=detectors, host_memory_limit_bytes=host_memory_limit_bytes)
    analyzer.feed_all(events)
    return analyzer.finish()


def exit_code_for(analysis: Analysis) -> int:
    """0 without error findings, 1 with: the exit code of replay, demo and watch."""
    return EXIT_FINDINGS if analysis.errors else EXIT_OK
