"""What `kvdoctor watch` shows while it samples: the live table on a TTY; without one, a stream of
lines (JSON or text) as it samples and finds, and a line for each host-growth attribution.

The table is redrawn at most twice a second and runs the (costlier) growth test at most every few
seconds, so drawing never slows the sampling down.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol, TextIO

from kvdoctor.analysis import growth
from kvdoctor.analysis.detectors.memory_growth import MemoryGrowthDetector
from kvdoctor.analysis.findings import Finding
from kvdoctor.outputs import one_line, reader_may_leave, strict
from kvdoctor.units import format_duration, format_optional_bytes, format_rate, short_title


class _Process(Protocol):
    pid: int
    title: str


class _Tracked(Protocol):
    info: _Process


class SampledTree(Protocol):
    """What the live view reads of a sampler: how many rounds, and the processes being followed."""

    rounds: int
    processes: dict[int, Any]


SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
LIVE_REFRESH_S = 0.5  # the live table is redrawn at most this often
LIVE_GROWTH_EVERY_S = 5.0  # the (costlier) growth test for the table runs at most this often
LIVE_RATE_WINDOW_S = 60.0  # the table's rate column is the slope over this recent span
FLAG_CLASSES = ("anon", "pinned", "gpu", "rss")  # a row is flagged by the first of these that grows
STREAM_SCHEMA_ID = "kvdoctor.watch/1"  # as the summary's (kvdoctor.formats.live.summary); each line's "type" says which


def sparkline(values: list[float], width: int = 24) -> str:
    """A trend in one cell: the last `width` samples (or evenly picked ones) as block heights."""
    if not values:
        return ""
    if len(values) > width:
        step = len(values) / width
        values = [values[min(len(values) - 1, int(k * step + step - 1))] for k in range(width)]
    lo, hi = min(values), max(values)
    if hi - lo <= 0:
        return SPARK_BLOCKS[0] * len(values)
    top = len(SPARK_BLOCKS) - 1
    return "".join(SPARK_BLOCKS[int(round((v - lo) / (hi - lo) * top))] for v in values)


def display_title(title: str) -> str:
    """A process title as the table and the summary show it: one line, its control bytes written out
    (any process may set its title to anything)."""
    return one_line(short_title(title)) or "?"


class LiveView:
    """The table on a TTY: one row per process; cheap enough to redraw twice a second."""

    def __init__(self, sampler: SampledTree, detector: MemoryGrowthDetector, pid: int, console: Any = None) -> None:
        """`console`: where to draw (a rich Console; the terminal by default)."""
        from rich.console import Console
        from rich.live import Live

        self.sampler = sampler
        self.detector = detector
        self.pid = pid
        self.console = console if console is not None else Console()
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self._next_draw_s = 0.0
        self._next_growth_s = 0.0
        self._flagged: dict[int, growth.GrowthResult] = {}
        self._started_s = time.monotonic()

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.draw(force=True)
        self.live.__exit__(exc_type, exc, tb)

    def draw(self, force: bool = False) -> None:
        now_s = time.monotonic()
        if not force and now_s < self._next_draw_s:
            return
        self._next_draw_s = now_s + LIVE_REFRESH_S
        if force or now_s >= self._next_growth_s:
            self._next_growth_s = now_s + LIVE_GROWTH_EVERY_S
            self._flagged = {}
            for pid in self.detector.pids():
                for memory_class in FLAG_CLASSES:
                    result = self.detector.growth(pid, memory_class)
                    if result is not None:
                        self._flagged[pid] = result
                        break
        self.live.update(self.table(), refresh=True)

    def _recent_rate(self, times: list[float], rss: list[float]) -> float | None:
        recent = [i for i, t in enumerate(times) if t >= times[-1] - LIVE_RATE_WINDOW_S] if times else []
        if len(recent) < 5:
            return None
        est = growth.theil_sen([times[i] for i in recent], [rss[i] for i in recent], max_points=120)
        return est.slope if est is not None else None

    def table(self) -> Any:
        from rich import box
        from rich.table import Table

        elapsed_s = time.monotonic() - self._started_s
        table = Table(
            title=f"kvdoctor watch {self.pid} · {self.sampler.rounds} samples · {format_duration(elapsed_s)} · Ctrl-C to stop",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
        )
        tracked_all = list(self.sampler.processes.values())
        pids = [t.info.pid for t in tracked_all]
        show_pinned = any(self.detector.latest(p, "pinned") for p in pids)
        show_gpu = any(self.detector.latest(p, "gpu") is not None for p in pids)
        trend_width = 8 if self.console.width < 100 else 16
        columns = [("pid", 7), ("process", 8), ("rss", 8), ("anon", 8)]
        columns += [("pinned", 8)] if show_pinned else []
        columns += [("gpu", 8)] if show_gpu else []
        columns += [("rss trend", trend_width), ("growth", 13), ("OOM in", 7)]
        # the process column gets what the numbers leave over, so the rates never fall off
        fixed = sum(width + 3 for name, width in columns if name != "process") + 3
        process_width = max(8, min(32, self.console.width - fixed))
        for name, width in columns:
            table.add_column(
                name,
                justify="left" if name in ("process", "rss trend") else "right",
                no_wrap=True,
                min_width=process_width if name == "process" else width,
                max_width=process_width if name == "process" else None,
                overflow="ellipsis",
            )
        limit = self.detector.memory_limit_bytes()
        in_use = self.detector.host_bytes_in_use()
        latest = self.detector.latest
        for tracked in tracked_all:
            pid = tracked.info.pid
            times, rss = self.detector.series(pid, "rss")
            flagged = self._flagged.get(pid)
            shown_rate = flagged.bytes_per_s if flagged is not None else self._recent_rate(times, rss)
            tto = growth.time_to_oom_s(in_use, shown_rate, limit) if shown_rate else None
            cells = [
                str(pid),
                display_title(tracked.info.title),
                format_optional_bytes(latest(pid, "rss")),
                format_optional_bytes(latest(pid, "anon")),
            ]
            cells += [format_optional_bytes(latest(pid, "pinned"))] if show_pinned else []
            cells += [format_optional_bytes(latest(pid, "gpu"))] if show_gpu else []
            cells += [
                sparkline(rss[-48:], width=trend_width),
                format_rate(shown_rate, signed=True) + (" !" if flagged is not None else ""),
                format_duration(tto) if tto is not None else "—",
            ]
            table.add_row(*cells, style="bold red" if flagged is not None else "")
        return table


def attribution_line(finding: Finding) -> str:
    """A host-growth attribution as it happens, for a watch without the live table."""
    return f"kvdoctor: {one_line(finding.message)}"


def finding_key(finding: Finding) -> tuple[Any, ...]:
    """What makes a finding the same one from one look to the next: its kind, process and what of it
    (a memory class, an allocator), not its count or rate, which move as the watch goes on."""
    evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
    return (finding.kind, finding.pid, str(evidence.get("memory_class", "")), str(evidence.get("allocator", "")))


class WatchStream:
    """What a watch puts out as it goes without the live table, each line flushed so that a pipe
    (`| tee`, a log collector) sees it at once.

    `json`: one JSON line ("type": "sample") each round with every process's memory, one
    ("type": "finding") the first time each finding is seen, and at the end one ("type":
    "summary") holding the summary `--format json` prints, so the last line says what the watch
    concluded. Text: a line for each finding as it is first seen. Findings are looked for every
    `findings_every_s` (the growth test is the costly part of a round)."""

    def __init__(self, out: TextIO, *, as_json: bool, findings_every_s: float) -> None:
        self.out, self.as_json, self.findings_every_s = out, as_json, findings_every_s
        self._announced: dict[tuple[Any, ...], Finding] = {}
        self._next_findings_s = 0.0
        self._started_s = time.monotonic()
        self._gone = False
        self._samples = 0

    def _line(self, record: dict[str, Any]) -> None:
        line = json.dumps(strict({"schema": STREAM_SCHEMA_ID, **record, "time_s": round(time.time(), 3)}), default=str, allow_nan=False)
        self._write(line)

    def _write(self, line: str) -> None:
        if self._gone:
            return
        try:
            with reader_may_leave():  # the reader left (`| head`): the watch goes on, its trace too
                print(line, file=self.out, flush=True)
        except (OSError, ValueError):
            self._gone = True

    def round(self, samples: int, processes: list[dict[str, Any]], findings: Callable[[], list[Finding]]) -> None:
        """After each round of samples (`samples` of them so far): its line, then any finding not
        seen before."""
        elapsed_s = time.monotonic() - self._started_s
        if self.as_json and samples > self._samples:  # not a round that found the process gone
            self._samples = samples
            self._line({"type": "sample", "samples": samples, "elapsed_s": round(elapsed_s, 3), "processes": processes})
        if time.monotonic() >= self._next_findings_s:
            self._next_findings_s = time.monotonic() + self.findings_every_s
            self.announce(findings())

    def announce(self, findings: list[Finding]) -> None:
        """A line for each of `findings` not announced before."""
        for finding in findings:
            key = finding_key(finding)
            if key in self._announced:
                continue
            self._announced[key] = finding
            if self.as_json:
                self._line({"type": "finding", **finding.to_dict()})
            else:
                self._write(f"kvdoctor watch: {finding.severity.upper()} {finding.kind}: {one_line(finding.message)}")

    def summary(self, report: dict[str, Any], findings: list[Finding]) -> None:
        """The last line of a JSON stream: the watch's summary, after a line for each of its
        findings not yet announced; a finding announced earlier that the final analysis no longer
        makes (a growth that stopped) is listed under "no_longer_found", so the stream and the
        summary never disagree in silence."""
        self.announce(findings)
        final = {finding_key(f) for f in findings}
        gone = [f.to_dict() for key, f in self._announced.items() if key not in final]
        if self.as_json:
            self._line({"type": "summary", **report, "no_longer_found": gone})
