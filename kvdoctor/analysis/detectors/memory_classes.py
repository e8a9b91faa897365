"""Which part of a process's anonymous memory grows: the Python heap, the malloc heap, torch's
pinned host cache, or native memory nothing accounts for.

Reads the probe's `memory_classes` counters (kvdoctor/probe/readings/memory_classes.py) and runs the same
sustained-growth test as `memory_growth` (warm-up, every window growing, a minimum rate) on each
class, because the fix differs: Python objects kept alive (tracemalloc attribution names the
line), memory malloc'd and never freed (torch CPU tensors, a C/C++ extension), a pinned cache
that keeps growing (vllm#48165), or a native leak malloc's statistics cannot see (vllm#50150).

Native, unexplained growth is called a native leak only while the Python heap does not grow:
without tracemalloc the Python heap is a count of blocks, and CPython's small-object arenas are
then inside "native, unexplained", so growth there with growing blocks is reported as Python's.
A warning, not an error: the `memory_growth` finding on the same memory carries the budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvdoctor.analysis.findings import WARNING, Finding
from kvdoctor.analysis.growth import GrowthParams, GrowthResult, detect_growth_with, theil_sen
from kvdoctor.analysis.serving_start import ServingStart
from kvdoctor.trace import schema
from kvdoctor.units import HOUR_S, BoundedSeries, finite_number, format_bytes, short_title

MAX_POINTS_PER_SERIES = 20_000
TITLE_LIMIT = 60
_TEN_DAYS_S = 10 * 86400.0
_MIN_SERIES_POINTS = 4
# Turns the minimum rate in bytes into one in Python blocks: a typical small object's size, so a
# block count must grow by about as many objects as the byte threshold would take.
ASSUMED_BYTES_PER_BLOCK = 64

ANON = "anon"
PYTHON = "python_heap"
PYTHON_BLOCKS = "python_blocks"
MALLOC = "malloc_heap"
PINNED = "pinned_cache"
NATIVE = "native_unexplained"

# The arguments of a MEMORY_CLASSES event that carry each series, the first present is used
# (the malloc heap apart from tracemalloc's own bookkeeping, else all of malloc's bytes in use).
SERIES_ARGS = {
    ANON: ("anon_bytes",),
    PYTHON: ("python_heap_bytes",),
    PYTHON_BLOCKS: ("python_blocks",),
    MALLOC: ("malloc_heap_bytes", "malloc_in_use_bytes"),
    PINNED: ("pinned_cache_bytes",),
    NATIVE: ("native_unexplained_bytes",),
}

CLASS_LABEL = {
    PYTHON: "the Python heap",
    MALLOC: "the malloc heap",
    PINNED: "torch's pinned host cache",
    NATIVE: "native, unexplained memory",
}


class MemoryClassGrowthDetector:
    """Collects MEMORY_CLASSES events and names, per process, each memory class that grows."""

    consumes = frozenset({schema.HEADER, schema.MEMORY_CLASSES, schema.PROBE_STATUS})

    def __init__(self, params: GrowthParams | None = None, *, max_points_per_series: int = MAX_POINTS_PER_SERIES) -> None:
        self.params = params or GrowthParams()
        self._max_points = max(_MIN_SERIES_POINTS, max_points_per_series)
        self._series: dict[tuple[int, str], BoundedSeries[float]] = {}
        self._latest: dict[int, dict[str, Any]] = {}
        self._titles: dict[int, str] = {}
        self._start_s: dict[int, float] = {}
        self.serving = ServingStart()  # an engine's start-up lasts until it first serves

    def feed(self, event: schema.Event) -> None:
        if event.name in ServingStart.consumes:
            self.serving.feed(event)
        if event.name == schema.HEADER and event.ph == "M":
            title = event.args.get("process_title")
            if isinstance(title, str) and title:
                self._titles.setdefault(event.pid, title)
            start = finite_number(event.args.get("process_start_s"))
            if start is not None:
                self._start_s[event.pid] = start
            return
        if event.name != schema.MEMORY_CLASSES or event.ph != "C":
            return
        t_s = event.ts / 1e6
        self._latest[event.pid] = event.args
        for series_name, names in SERIES_ARGS.items():
            value = next((v for v in (finite_number(event.args.get(name)) for name in names) if v is not None), None)
            if value is None:
                continue
            key = (event.pid, series_name)
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = BoundedSeries(self._max_points)
            if not series.times or t_s > series.times[-1]:
                series.add(t_s, value)

    def forget(self, pid: int) -> None:
        """Drops a process the analysis set aside for one that tells more (kvdoctor.analysis.admission)."""
        for key in [key for key in self._series if key[0] == pid]:
            del self._series[key]
        for table in (self._latest, self._titles, self._start_s):
            table.pop(pid, None)
        self.serving.forget(pid)

    def _origin(self, pid: int, first_s: float) -> float | None:
        origin = self._start_s.get(pid)
        if origin is not None and not (first_s - _TEN_DAYS_S <= origin <= first_s + 1.0):
            return None  # a clock that is not the epoch: count warm-up from the first sample
        return origin

    def growth(self, pid: int, series_name: str) -> GrowthResult | None:
        s = self._series.get((pid, series_name))
        if s is None or len(s) < 3:
            return None
        params = self.params
        if series_name == PYTHON_BLOCKS:
            params = dataclasses.replace(
                params,
                min_rate_bytes_per_s=params.min_rate_bytes_per_s / ASSUMED_BYTES_PER_BLOCK,
                min_rise_bytes=params.min_rise_bytes / ASSUMED_BYTES_PER_BLOCK,
            )
        origin = self._origin(pid, s.times[0])
        return detect_growth_with(params, s.times, s.values, origin_s=origin, ready_s=self.serving.ready_s(pid, origin or s.times[0]))

    def _anon_rate(self, pid: int, grown: GrowthResult | None) -> float | None:
        """The anonymous memory's rate for context: its growth when sustained, else its slope."""
        if grown is not None:
            return grown.bytes_per_s
        s = self._series.get((pid, ANON))
        if s is None or len(s) < 3:
            return None
        estimate = theil_sen(s.times, s.values, max_points=self.params.max_points)
        return estimate.slope if estimate is not None else None

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        for pid in sorted({pid for pid, _ in self._series}):
            grown = {name: self.growth(pid, name) for name in SERIES_ARGS}
            anon_rate = self._anon_rate(pid, grown[ANON])
            traced = grown[PYTHON]
            python = traced or grown[PYTHON_BLOCKS]
            malloc, native_growth, pinned = grown[MALLOC], grown[NATIVE], grown[PINNED]
            if traced is not None:
                # Python's own growth shows in malloc (large objects) and outside it (arena
                # rounding): only growth beyond the Python heap's rate is another class's.
                malloc = malloc if malloc is not None and malloc.bytes_per_s > traced.bytes_per_s else None
                native_growth = native_growth if native_growth is not None and native_growth.bytes_per_s > traced.bytes_per_s else None
            if python is not None:
                arenas = grown[NATIVE] if traced is None else None
                text = self._python_text(traced is not None, arenas)
                out.append(self._finding(pid, PYTHON, python, anon_rate, text, blocks=traced is None))
            if malloc is not None:
                out.append(self._finding(pid, MALLOC, malloc, anon_rate, self._malloc_text(python is not None)))
            if native_growth is not None and (python is None or traced is not None):
                flat = [CLASS_LABEL[name] for name, result in ((PYTHON, python), (MALLOC, malloc)) if result is None]
                out.append(self._finding(pid, NATIVE, native_growth, anon_rate, self._native_text(flat)))
            if pinned is not None:
                out.append(self._finding(pid, PINNED, pinned, None, self._pinned_text(pid)))
        out.sort(key=lambda f: -float(f.evidence.get("bytes_per_s", 0.0)))
        return out

    # -- sentences ---------------------------------------------------------------------------------
    def _python_text(self, by_bytes: bool, native: GrowthResult | None) -> str:
        if by_bytes:
            return "Python objects kept alive (tracemalloc's total); KVDOCTOR_ATTRIBUTION=1 names the file:line that grows"
        arenas = (
            f"; the {_rate(native.bytes_per_s)}/h of anonymous memory outside malloc is most likely its small-object arenas"
            if native is not None
            else ""
        )
        return (
            "Python objects kept alive (allocated blocks: tracemalloc is off, so no bytes" + arenas + "); "
            "KVDOCTOR_ATTRIBUTION=1 names the file:line that grows"
        )

    def _malloc_text(self, python_grows: bool) -> str:
        if python_grows:
            return "the Python heap grows too, and large Python objects are malloc'd: part of this may be them"
        return (
            "while the Python heap is flat: memory malloc'd and never freed (torch CPU tensors, a C/C++ extension's malloc), "
            "which tracemalloc does not see"
        )

    def _native_text(self, flat: list[str]) -> str:
        while_flat = f"while {' and '.join(flat)} {'are' if len(flat) > 1 else 'is'} flat: " if flat else ": "
        return (
            while_flat + "a leak in native code (a C/C++ extension's own mmap or allocator), which neither tracemalloc "
            "nor malloc's statistics see"
        )

    def _pinned_text(self, pid: int) -> str:
        latest = self._latest.get(pid, {})
        cached = finite_number(latest.get("pinned_cache_blocks"))
        active = finite_number(latest.get("pinned_active_blocks"))
        held = (
            f"{cached:.0f} pinned blocks cached, {active:.0f} in use now" if cached is not None and active is not None else "pinned blocks"
        )
        return f"({held}): pinned buffers are cached and not reused (vllm#48165); shared /dev/zero memory, not anonymous"

    def _finding(
        self, pid: int, memory_class: str, result: GrowthResult, anon_rate: float | None, explanation: str, *, blocks: bool = False
    ) -> Finding:
        title = self._titles.get(pid, "")
        who = f"{short_title(title, TITLE_LIMIT)} (pid {pid})" if title else f"pid {pid}"
        rate = f"{result.bytes_per_hour:+,.0f} allocated blocks/h" if blocks else f"{_rate(result.bytes_per_s)}/h"
        lower = f"{result.lower_bytes_per_hour:,.0f} blocks/h" if blocks else f"{format_bytes(result.lower_bytes_per_hour)}/h"
        if memory_class in (MALLOC, NATIVE) and anon_rate is not None:
            head = f"{who} anonymous memory {_rate(anon_rate)}/h, of which {CLASS_LABEL[memory_class]} {rate}"
        else:
            head = f"{who} {CLASS_LABEL[memory_class]} grows {rate}"
        message = f"{head} (≥ {lower} at {result.confidence * 100:.0f}%, sustained over {result.windows} windows) {explanation}"
        latest = self._latest.get(pid, {})
        evidence: dict[str, Any] = {
            "memory_class": memory_class,
            "unit": "blocks" if blocks else "bytes",
            "pid": pid,
            "process_title": title,
            "bytes_per_s": 0.0 if blocks else result.bytes_per_s,
            "bytes_per_hour": 0.0 if blocks else result.bytes_per_hour,
            "rate_per_s": result.bytes_per_s,
            "lower_bound_per_s": result.lower_bytes_per_s,
            "confidence": result.confidence,
            "windows": result.windows,
            "samples": result.samples,
            "window_start_s": result.window_start_s,
            "window_end_s": result.window_end_s,
            "anon_bytes_per_s": anon_rate,
            "python_heap_source": latest.get("python_heap_source"),
            "latest": {k: v for k, v in latest.items() if isinstance(v, (int, float, str))},
        }
        return Finding(
            kind=schema.MEMORY_CLASS_GROWTH, severity=WARNING, message=message, count=1, evidence=evidence, pid=pid, unit="class"
        )


def _rate(bytes_per_s: float) -> str:
    """A signed rate per hour: "+320 MiB", "-12.0 MiB"."""
    per_hour = bytes_per_s * HOUR_S
    return ("+" if per_hour >= 0 else "") + format_bytes(per_hour)
