"""Runs every detector over one event stream (live or recorded) and collects the findings."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from kvdoctor.trace import schema
from kvdoctor.analysis.detectors.base import Detector
from kvdoctor.analysis.detectors.double_alloc import DoubleAllocDetector
from kvdoctor.analysis.detectors.double_free import DoubleFreeDetector
from kvdoctor.analysis.detectors.graph_replay import GraphReplayDuringLoadDetector
from kvdoctor.analysis.detectors.index_out_of_range import IndexOutOfRangeDetector
from kvdoctor.analysis.detectors.orphan_slots import OrphanSlotsDetector
from kvdoctor.analysis.detectors.probe_health import ProbeHealthDetector
from kvdoctor.analysis.detectors.refcount_disagrees import RefcountDisagreesDetector
from kvdoctor.analysis.detectors.stale_last_loc import StaleLastLocDetector
from kvdoctor.analysis.detectors.tree_misuse import LockUnderflowDetector, UseAfterFreeDetector
from kvdoctor.analysis.findings import ERROR, INFO, WARNING, Finding

SEVERITY_ORDER = {ERROR: 0, WARNING: 1, INFO: 2}


def all_detectors() -> list[Detector]:
    detectors: list[Detector] = [
        DoubleFreeDetector(),
        DoubleAllocDetector(),
        StaleLastLocDetector(),
        IndexOutOfRangeDetector(),
        UseAfterFreeDetector(),
        LockUnderflowDetector(),
        GraphReplayDuringLoadDetector(),
        RefcountDisagreesDetector(),
        OrphanSlotsDetector(),
        ProbeHealthDetector(),
    ]
    from kvdoctor.analysis.detectors.host_growth_attribution import HostGrowthAttributionDetector
    from kvdoctor.analysis.detectors.memory_growth import MemoryGrowthDetector
    from kvdoctor.analysis.detectors.retained_view import RetainedViewDetector

    detectors.append(MemoryGrowthDetector())
    detectors.append(RetainedViewDetector())
    detectors.append(HostGrowthAttributionDetector())
    return detectors


@dataclasses.dataclass
class Analysis:
    """A finished analysis: what reporters render. Knows nothing of how it was made."""

    findings: list[Finding]
    processes: dict[int, dict[str, Any]]
    events: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    source: str = ""
    series: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": schema.SCHEMA_ID,
            "source": self.source,
            "events": self.events,
            "findings": [f.to_dict() for f in self.findings],
            "processes": {str(pid): info for pid, info in self.processes.items()},
            "notes": self.notes,
        }


class SeriesCollector:
    """Keeps the counters reporters plot (ledger sizes, memory), decimated to bounded size."""

    consumes = frozenset({schema.LEDGER_COUNTER, schema.MEMORY_COUNTER, schema.HICACHE_COUNTER})

    MAX_POINTS = 4000

    def __init__(self) -> None:
        self.series: dict[str, dict[str, list]] = {}

    def feed(self, event: schema.Event) -> None:
        if event.ph != "C":
            return
        label = f"{event.name}:{event.pid}:{event.args.get('allocator', '')}"
        entry = self.series.setdefault(label, {"ts_us": [], "values": [], "stride": 1, "seen": 0})
        entry["seen"] += 1
        if (entry["seen"] - 1) % entry["stride"]:
            return
        entry["ts_us"].append(event.ts)
        entry["values"].append({k: v for k, v in event.args.items() if isinstance(v, (int, float))})
        if len(entry["ts_us"]) >= self.MAX_POINTS:
            entry["ts_us"] = entry["ts_us"][::2]
            entry["values"] = entry["values"][::2]
            entry["stride"] *= 2


def analyze(events: Iterable[schema.Event], *, source: str = "", detectors: list[Detector] | None = None) -> Analysis:
    """Feeds each event only to the detectors that read its name (a detector without a
    `consumes` set sees everything), so large traces replay at streaming speed."""
    detectors = detectors if detectors is not None else all_detectors()
    processes: dict[int, dict[str, Any]] = {}
    series = SeriesCollector()
    sinks = [series, *detectors]
    routes: dict[str, list] = {}
    count = 0
    for event in events:
        count += 1
        name = event.name
        feeds = routes.get(name)
        if feeds is None:
            feeds = routes[name] = [s.feed for s in sinks if getattr(s, "consumes", None) is None or name in s.consumes]
        if name in (schema.HEADER, schema.RUN_HEADER):
            info = processes.setdefault(event.pid, {})
            info.update({k: event.args.get(k) for k in ("engine", "engine_version", "process_title") if event.args.get(k)})
        elif name == schema.PROCESS_NAME and event.args.get("name"):
            processes.setdefault(event.pid, {})["process_title"] = event.args["name"]
        for feed in feeds:
            feed(event)
    findings: list[Finding] = []
    for detector in detectors:
        findings.extend(detector.findings())
    findings.sort(key=lambda f: (SEVERITY_ORDER.get(f.severity, 9), f.kind, -f.count))
    return Analysis(findings=findings, processes=processes, events=count, source=source, series=series.series)
