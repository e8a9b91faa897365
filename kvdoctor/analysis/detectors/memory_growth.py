"""Memory that keeps growing, per process and per memory class, from the sampler's counters.

A finding names the process (by its title, e.g. `sglang::scheduler`) and the class that grows
(anonymous heap, pinned host memory, GPU memory, shared memory), because the fix differs for
each. Overlapping classes are reported once: pinned /dev/zero mappings are part of shmem, and
rss is the sum of anon, file and shmem, so shmem is reported only when pinned does not explain
it, and rss only when no narrower class grows.
"""

from __future__ import annotations

import operator
from typing import Any, cast

from kvdoctor.analysis.findings import ERROR, Finding
from kvdoctor.analysis.growth import GrowthParams, GrowthResult, detect_growth_with, time_to_oom_s
from kvdoctor.analysis.growth_verdict import growth_evidence
from kvdoctor.analysis.serving_start import ServingStart
from kvdoctor.trace import schema
from kvdoctor.trace.counter_block import CounterBlock
from kvdoctor.units import BoundedSeries, finite_number, format_bytes, format_duration, short_title

MAX_POINTS_PER_SERIES = 20_000
TITLE_LIMIT = 60

# The argument of a MEMORY_COUNTER event that carries each memory class (the sampler writes them).
CLASS_ARG = {
    "anon": "anon_bytes",
    "shmem": "shmem_bytes",
    "file": "file_bytes",
    "pinned": "pinned_bytes",
    "gpu": "gpu_bytes",
    "rss": "rss_bytes",
}

# Classes in reporting order; rss comes last and only stands in when nothing narrower grew.
REPORTED_CLASSES = ("anon", "pinned", "gpu", "shmem", "rss")
HOST_CLASSES = ("anon", "pinned", "shmem", "rss", "file")

CLASS_LABEL = {
    "anon": "anonymous memory",
    "pinned": "pinned host memory",
    "gpu": "GPU memory",
    "shmem": "shared memory",
    "file": "file-backed memory",
    "rss": "resident memory",
}

_TEN_DAYS_S = 10 * 86400.0
_MIN_SERIES_POINTS = 4


class MemoryGrowthDetector:
    """Collects MEMORY_COUNTER events and reports each (process, memory class) that grows.

    `params` tunes the growth test (warm-up, windows, minimum rate; see kvdoctor.analysis.growth).
    Warm-up is counted from the process's start when its header gives it, so a server that has
    run for hours is analysed from the first sample. The host limit used for the time to OOM is
    `memory_limit_bytes` when given, else the one the sampler recorded in the trace, else
    `host_memory_limit_bytes` (the caller's machine: analysis itself reads no /proc).
    """

    consumes = frozenset({schema.HEADER, schema.RUN_HEADER, schema.MEMORY_COUNTER, schema.PROBE_STATUS})
    counter_state_apart = False  # its headers and its samples reach it in trace order

    def __init__(
        self,
        params: GrowthParams | None = None,
        *,
        memory_limit_bytes: int | None = None,
        host_memory_limit_bytes: int | None = None,
        max_points_per_series: int = MAX_POINTS_PER_SERIES,
    ) -> None:
        self.params = params or GrowthParams()
        self._limit_override = memory_limit_bytes
        self._recorded_limit: int | None = None
        self._host_limit = host_memory_limit_bytes
        self._max_points = max(_MIN_SERIES_POINTS, max_points_per_series)
        self._series: dict[tuple[int, str], BoundedSeries[float]] = {}
        self._latest: dict[tuple[int, str], float] = {}
        self._titles: dict[int, str] = {}
        self._start_s: dict[int, float] = {}
        self._gpu_total: dict[int, float] = {}
        self._last_ts_s: dict[int, float] = {}
        self._last_rss: dict[int, float] = {}
        self.serving = ServingStart()  # an engine's start-up lasts until it first serves

    # -- input -----------------------------------------------------------------------------
    def feed(self, event: schema.Event) -> None:
        if event.name in ServingStart.consumes:
            self.serving.feed(event)
        if event.name in (schema.HEADER, schema.RUN_HEADER) and event.ph == "M":
            args = event.args
            title = args.get("process_title")
            if event.name == schema.HEADER and isinstance(title, str) and title:
                self._titles[event.pid] = title
            start = finite_number(args.get("process_start_s"))
            if event.name == schema.HEADER and start is not None:
                self._start_s[event.pid] = start
            limit = finite_number(args.get("memory_limit_bytes"))
            if limit is not None and limit > 0 and self._recorded_limit is None:
                self._recorded_limit = int(limit)
            return
        if event.name != schema.MEMORY_COUNTER or event.ph != "C":
            return
        pid = event.pid
        args = event.args
        t_s = event.ts / 1e6
        title = args.get("title")
        if isinstance(title, str) and title:
            self._titles[pid] = title
        for memory_class, arg in CLASS_ARG.items():
            value = finite_number(args.get(arg))
            if value is None:
                continue
            key = (pid, memory_class)
            self._latest[key] = value
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = BoundedSeries(self._max_points)
            if not series.times or t_s > series.times[-1]:  # the fit needs increasing times
                series.add(t_s, value)
        total = finite_number(args.get("gpu_total_bytes"))
        if total is not None and total > 0:
            self._gpu_total[pid] = total
        rss = finite_number(args.get("rss_bytes"))
        if rss is not None:
            self._last_rss[pid] = rss
        self._last_ts_s[pid] = max(t_s, self._last_ts_s.get(pid, t_s))

    def forget(self, pid: int) -> None:
        """Drops a process the analysis set aside for one that tells more (kvdoctor.analysis.admission)."""
        for key in [key for key in self._series if key[0] == pid]:
            del self._series[key]
            self._latest.pop(key, None)
        for table in (self._titles, self._start_s, self._gpu_total, self._last_ts_s, self._last_rss):
            table.pop(pid, None)
        self.serving.forget(pid)

    def feed_counter_block(self, block: CounterBlock) -> None:
        """`feed` for each line of one process's counter block, a memory class at a time: the
        classes keep separate state, so only the order within each one matters."""
        if block.name != schema.MEMORY_COUNTER:
            return
        pid = block.pid
        times = [ts / 1e6 for ts in block.timestamps()]
        title = block.last_text("title")
        if title:
            self._titles[pid] = title
        rising = all(map(operator.lt, times, times[1:]))
        finite: dict[str, list[float | None] | None] = {}
        for memory_class, arg in CLASS_ARG.items():
            values = finite[arg] = self._finite_values(block, arg)
            if values is None:
                continue
            key = (pid, memory_class)
            if None not in values and rising:
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = BoundedSeries(self._max_points)
                if not series.times or times[0] > series.times[-1]:
                    present = cast("list[float]", values)
                    self._latest[key] = present[-1]
                    series.extend(times, present)
                    continue
            for t_s, value in zip(times, values, strict=True):
                if value is None:
                    continue
                self._latest[key] = value
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = BoundedSeries(self._max_points)
                if not series.times or t_s > series.times[-1]:
                    series.add(t_s, value)
        totals = self._finite_values(block, "gpu_total_bytes")
        for total in reversed(totals or []):
            if total is not None and total > 0:
                self._gpu_total[pid] = total
                break
        rss = [value for value in finite.get("rss_bytes") or [] if value is not None]
        if rss:
            self._last_rss[pid] = rss[-1]
        latest = max(times)
        self._last_ts_s[pid] = max(latest, self._last_ts_s.get(pid, latest))

    @staticmethod
    def _finite_values(block: CounterBlock, arg: str) -> list[float | None] | None:
        """`finite_number` of argument `arg` in every line; None when no line has it as a number.
        Within the bounds a known shape checked, a number's `finite_number` is its float()."""
        return block.floats_where_present(arg)

    # -- queries used by the live view ----------------------------------------------------------
    def pids(self) -> list[int]:
        return sorted({pid for pid, _ in self._series})

    def title(self, pid: int) -> str:
        return self._titles.get(pid, "")

    def series(self, pid: int, memory_class: str) -> tuple[list[float], list[float]]:
        s = self._series.get((pid, memory_class))
        return (list(s.times), list(s.values)) if s is not None else ([], [])

    def latest(self, pid: int, memory_class: str) -> float | None:
        return self._latest.get((pid, memory_class))

    def memory_limit_bytes(self) -> int | None:
        if self._limit_override is not None:
            return self._limit_override
        if self._recorded_limit is not None:
            return self._recorded_limit
        return self._host_limit

    def host_bytes_in_use(self) -> float:
        """Resident memory of the processes still sampled at the end: what shares the limit."""
        if not self._last_ts_s:
            return 0.0
        latest = max(self._last_ts_s.values())
        recent = [pid for pid, t in self._last_ts_s.items() if latest - t <= 5.0]
        return sum(self._last_rss.get(pid, 0.0) for pid in recent)

    def _origin(self, pid: int, first_s: float) -> float | None:
        origin = self._start_s.get(pid)
        if origin is not None and not (first_s - _TEN_DAYS_S <= origin <= first_s + 1.0):
            return None  # a clock that is not the epoch: count warm-up from the first sample
        return origin

    def growth(self, pid: int, memory_class: str) -> GrowthResult | None:
        s = self._series.get((pid, memory_class))
        if s is None or len(s) < 3:
            return None
        origin = self._origin(pid, s.times[0])
        return detect_growth_with(self.params, s.times, s.values, origin_s=origin, ready_s=self.serving.ready_s(pid, origin or s.times[0]))

    def growth_verdicts(self) -> list[dict[str, Any]]:
        """Per process and reported memory class, the evidence a growth budget is judged on
        (kvdoctor.analysis.growth_verdict), and whether the process stopped being sampled well
        before the others (it exited during the run: what it held went with it)."""
        out: list[dict[str, Any]] = []
        last = max(self._last_ts_s.values(), default=0.0)
        for (pid, memory_class), s in sorted(self._series.items()):
            if memory_class not in REPORTED_CLASSES or not s.times:
                continue
            origin = self._origin(pid, s.times[0])
            ready = self.serving.ready_s(pid, origin or s.times[0])
            evidence = growth_evidence(self.params, s.times, s.values, origin_s=origin, ready_s=ready)
            if evidence is None:
                continue
            gap = max(5.0, 3 * (s.times[-1] - s.times[0]) / max(len(s) - 1, 1))
            out.append(
                {
                    "pid": pid,
                    "memory_class": memory_class,
                    "process_title": self._titles.get(pid, ""),
                    "exited_early": last - self._last_ts_s.get(pid, last) > gap,
                    **evidence.to_dict(),
                }
            )
        return out

    # -- output ----------------------------------------------------------------------------------
    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        for pid in self.pids():
            grown: dict[str, GrowthResult] = {}
            for memory_class in REPORTED_CLASSES:
                if memory_class == "shmem" and "pinned" in grown:
                    continue
                if memory_class == "rss" and grown:
                    continue
                result = self.growth(pid, memory_class)
                if result is not None:
                    grown[memory_class] = result
            for memory_class, result in grown.items():
                out.append(self._finding(pid, memory_class, result))
        out.sort(key=lambda f: -float(f.evidence.get("bytes_per_s", 0.0)))
        return out

    def _finding(self, pid: int, memory_class: str, result: GrowthResult) -> Finding:
        title = self._titles.get(pid, "")
        current = self.latest(pid, memory_class) or 0.0
        if memory_class == "gpu":
            limit = self._gpu_total.get(pid)
            in_use = current
            limit_name = "the GPU's memory"
        else:
            limit = self.memory_limit_bytes()
            in_use = max(self.host_bytes_in_use(), current)
            limit_name = "the memory limit"
        tto = time_to_oom_s(in_use, result.bytes_per_s, limit)
        who = f"{short_title(title, TITLE_LIMIT)} (pid {pid})" if title else f"pid {pid}"
        conf_pct = f"{result.confidence * 100:.0f}%"
        message = (
            f"{who} {CLASS_LABEL[memory_class]} grows {format_bytes(result.bytes_per_hour)}/h "
            f"(≥ {format_bytes(result.lower_bytes_per_hour)}/h at {conf_pct}), "
            f"sustained over {result.windows} windows of {format_duration(result.duration_s / result.windows)}"
        )
        if tto is not None:
            message += f"; at this rate it reaches {limit_name} in {format_duration(tto)}"
        evidence: dict[str, Any] = {
            "memory_class": memory_class,
            "pid": pid,
            "process_title": title,
            "bytes_per_s": result.bytes_per_s,
            "bytes_per_hour": result.bytes_per_hour,
            "lower_bound_bytes_per_s": result.lower_bytes_per_s,
            "upper_bound_bytes_per_s": result.upper_bytes_per_s,
            "confidence": result.confidence,
            "window_start_s": result.window_start_s,
            "window_end_s": result.window_end_s,
            "windows": result.windows,
            "window_slopes_bytes_per_s": list(result.window_slopes_bytes_per_s),
            "samples": result.samples,
            "start_bytes": result.start_bytes,
            "current_bytes": current,
            "limit_bytes": limit,
            "time_to_oom_s": tto,
        }
        return Finding(kind=schema.MEMORY_GROWTH, severity=ERROR, message=message, count=1, evidence=evidence, pid=pid, unit="process")
