"""Memory that keeps growing, per process and per memory class, from the sampler's counters.

A finding names the process (by its title, e.g. `sglang::scheduler`) and the class that grows
(anonymous heap, pinned host memory, GPU memory, shared memory), because the fix differs for
each. Overlapping classes are reported once: pinned /dev/zero mappings are part of shmem, and
rss is the sum of anon, file and shmem, so shmem is reported only when pinned does not explain
it, and rss only when no narrower class grows.
"""

from __future__ import annotations

import math
from typing import Any

from kvdoctor.analysis import growth
from kvdoctor.trace import schema
from kvdoctor.analysis.findings import ERROR, Finding
from kvdoctor.collect.sampler import CLASS_ARG, machine_memory_limit_bytes

MAX_POINTS_PER_SERIES = 20_000

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


class _Series:
    """A time series that never holds more than `max_points`: when full, it drops every other
    point and from then on keeps every 2nd (then 4th, ...) new one, so density stays even."""

    __slots__ = ("times_s", "values", "stride", "_skip", "max_points", "last_value")

    def __init__(self, max_points: int) -> None:
        self.times_s: list[float] = []
        self.values: list[float] = []
        self.stride = 1
        self._skip = 0
        self.max_points = max(4, max_points)
        self.last_value: float | None = None

    def add(self, t_s: float, value: float) -> None:
        self.last_value = value
        if self.times_s and t_s <= self.times_s[-1]:
            return  # out-of-order or duplicate timestamp: the fit needs increasing times
        if self._skip > 0:
            self._skip -= 1
            return
        self.times_s.append(t_s)
        self.values.append(value)
        self._skip = self.stride - 1
        if len(self.times_s) > self.max_points:
            self.times_s = self.times_s[::2]
            self.values = self.values[::2]
            self.stride *= 2
            self._skip = self.stride - 1

    def __len__(self) -> int:
        return len(self.times_s)


def _short_title(title: str, limit: int = 60) -> str:
    """One line for a message: whitespace collapsed, an interpreter's path cut to its name."""
    words = title.split()
    if words and "/" in words[0] and "::" not in words[0]:
        words[0] = words[0].rsplit("/", 1)[-1]
    title = " ".join(words)
    return title if len(title) <= limit else title[: limit - 1] + "…"


def _number(value: Any) -> float | None:
    kind = type(value)
    if kind is int:
        return float(value) if -(1 << 62) < value < (1 << 62) else None
    if kind is not float:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class MemoryGrowthDetector:
    """Collects MEMORY_COUNTER events and reports each (process, memory class) that grows.

    `params` tunes the growth test (warm-up, windows, minimum rate; see kvdoctor.growth).
    Warm-up is counted from the process's start when its header gives it, so a server that has
    run for hours is analysed from the first sample. `memory_limit_bytes` overrides the host
    limit used for the time to OOM (default: the one the sampler recorded, else this machine's).
    """

    consumes = frozenset({schema.HEADER, schema.RUN_HEADER, schema.MEMORY_COUNTER})

    def __init__(
        self,
        params: growth.GrowthParams | None = None,
        *,
        memory_limit_bytes: int | None = None,
        max_points_per_series: int = MAX_POINTS_PER_SERIES,
    ) -> None:
        self.params = params or growth.GrowthParams()
        self._limit_override = memory_limit_bytes
        self._recorded_limit: int | None = None
        self._max_points = max_points_per_series
        self._series: dict[tuple[int, str], _Series] = {}
        self._titles: dict[int, str] = {}
        self._start_s: dict[int, float] = {}
        self._gpu_total: dict[int, float] = {}
        self._last_ts_s: dict[int, float] = {}
        self._last_rss: dict[int, float] = {}

    # -- input -----------------------------------------------------------------------------
    def feed(self, event: schema.Event) -> None:
        if event.name in (schema.HEADER, schema.RUN_HEADER) and event.ph == "M":
            args = event.args
            title = args.get("process_title")
            if event.name == schema.HEADER and isinstance(title, str) and title:
                self._titles[event.pid] = title
            start = _number(args.get("process_start_s"))
            if event.name == schema.HEADER and start is not None:
                self._start_s[event.pid] = start
            limit = _number(args.get("memory_limit_bytes"))
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
            value = _number(args.get(arg))
            if value is None:
                continue
            key = (pid, memory_class)
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series(self._max_points)
            series.add(t_s, value)
        total = _number(args.get("gpu_total_bytes"))
        if total is not None and total > 0:
            self._gpu_total[pid] = total
        rss = _number(args.get("rss_bytes"))
        if rss is not None:
            self._last_rss[pid] = rss
        self._last_ts_s[pid] = max(t_s, self._last_ts_s.get(pid, t_s))

    # -- queries used by the live view ----------------------------------------------------------
    def pids(self) -> list[int]:
        return sorted({pid for pid, _ in self._series})

    def title(self, pid: int) -> str:
        return self._titles.get(pid, "")

    def series(self, pid: int, memory_class: str) -> tuple[list[float], list[float]]:
        s = self._series.get((pid, memory_class))
        return (list(s.times_s), list(s.values)) if s is not None else ([], [])

    def latest(self, pid: int, memory_class: str) -> float | None:
        s = self._series.get((pid, memory_class))
        return s.last_value if s is not None else None

    def memory_limit_bytes(self) -> int | None:
        if self._limit_override is not None:
            return self._limit_override
        if self._recorded_limit is not None:
            return self._recorded_limit
        return machine_memory_limit_bytes()

    def host_bytes_in_use(self) -> float:
        """Resident memory of the processes still sampled at the end: what shares the limit."""
        if not self._last_ts_s:
            return 0.0
        latest = max(self._last_ts_s.values())
        recent = [pid for pid, t in self._last_ts_s.items() if latest - t <= 5.0]
        return sum(self._last_rss.get(pid, 0.0) for pid in recent)

    def growth(self, pid: int, memory_class: str) -> growth.GrowthResult | None:
        s = self._series.get((pid, memory_class))
        if s is None or len(s) < 3:
            return None
        origin = self._start_s.get(pid)
        if origin is not None and not (s.times_s[0] - _TEN_DAYS_S <= origin <= s.times_s[0] + 1.0):
            origin = None  # a clock that is not the epoch: count warm-up from the first sample
        return growth.detect_growth_with(self.params, s.times_s, s.values, origin_s=origin)

    # -- output ----------------------------------------------------------------------------------
    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        for pid in self.pids():
            grown: dict[str, growth.GrowthResult] = {}
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

    def _finding(self, pid: int, memory_class: str, result: growth.GrowthResult) -> Finding:
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
        tto = growth.time_to_oom_s(in_use, result.bytes_per_s, limit)
        who = f"{_short_title(title)} (pid {pid})" if title else f"pid {pid}"
        conf_pct = f"{result.confidence * 100:.0f}%"
        message = (
            f"{who} {CLASS_LABEL[memory_class]} grows {growth.format_bytes(result.bytes_per_hour)}/h "
            f"(≥ {growth.format_bytes(result.lower_bytes_per_hour)}/h at {conf_pct}), "
            f"sustained over {result.windows} windows of {growth.format_duration(result.duration_s / result.windows)}"
        )
        if tto is not None:
            message += f"; at this rate it reaches {limit_name} in {growth.format_duration(tto)}"
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
        return Finding(kind=schema.MEMORY_GROWTH, severity=ERROR, message=message, count=1, evidence=evidence, pid=pid)
