"""`kvdoctor watch PID`: a live server's memory over time, by process and class, and its growth.

Watching works from outside: /proc (and NVML for GPU memory) on a fixed interval, no ptrace and
nothing injected, so it is safe on a production server and needs only the server's user (or
root). The tree is followed: SGLang's scheduler and detokenizer or vLLM's engine core and
workers are sampled each on their own, and children that appear later are picked up.

Every watch writes a trace (`kvdoctor-watch-PID.kvtrace.json` unless told otherwise): a run
header, the sampler's counters, and at the end the findings. Giving `--trace` the path of a trace
that a `kvdoctor run` of the same server is still writing appends to it, so the probe's KV-slot
ledgers and the memory counters end up side by side (that trace is left for its owner to close).

It stops at `duration_s`, on Ctrl-C, or when the watched process exits, and then analyses what
was sampled. Exit code: 0 no error findings, 1 error findings, 2 nothing usable was sampled.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

from kvdoctor.analysis import growth
from kvdoctor.trace import schema
from kvdoctor.analysis.detectors.host_growth_attribution import HostGrowthAttributionDetector
from kvdoctor.analysis.detectors.memory_growth import MemoryGrowthDetector
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE, KvdoctorError
from kvdoctor.analysis.findings import ERROR, Finding
from kvdoctor.collect.procfs import check_process
from kvdoctor.collect.sampler import Sampler
from kvdoctor.trace.writer import TraceWriter, finish_trace, now_us
from kvdoctor.units import format_duration, format_optional_bytes, format_rate, short_title

OUTPUT_FORMATS = ("auto", "text", "json")
SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
LIVE_REFRESH_S = 0.5          # the live table is redrawn at most this often
LIVE_GROWTH_EVERY_S = 5.0     # the (costlier) growth test for the table runs at most this often
LIVE_RATE_WINDOW_S = 60.0     # the table's rate column is the slope over this recent span


def default_trace_path(pid: int) -> str:
    return os.path.abspath(f"kvdoctor-watch-{pid}.kvtrace.json")


def _open_trace(path: str | None, pid: int) -> tuple[TraceWriter, str, bool]:
    """The writer, the absolute path, and whether this watch owns (and so closes) the trace.

    The default path, or an existing trace that already ended, is replaced; an existing trace
    still being written (by `kvdoctor run`) is appended to and left open for its writer.
    """
    owned = True
    resolved = os.path.abspath(path) if path else default_trace_path(pid)
    try:
        if os.path.isdir(resolved):
            raise KvdoctorError(f"{resolved} is a directory", "give --trace a file path")
        if os.path.exists(resolved):
            with open(resolved, "rb") as fh:
                head = fh.read(1)
                fh.seek(max(0, os.path.getsize(resolved) - 16))
                tail = fh.read().rstrip()
            if path is None or tail.endswith(b"]") or os.path.getsize(resolved) == 0:
                os.remove(resolved)
            elif head == b"[":
                owned = False
            else:
                raise KvdoctorError(f"{resolved} exists and is not a kvdoctor trace", "choose another --trace path")
        writer = TraceWriter(resolved)
    except OSError as exc:
        raise KvdoctorError(f"cannot write the trace {resolved}: {exc.strerror or exc}", "pass --trace to a writable place") from None
    return writer, resolved, owned


def _sparkline(values: list[float], width: int = 24) -> str:
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


def _bytes(value: float | None) -> str:
    return format_optional_bytes(value)


def _rate_text(bytes_per_s: float | None) -> str:
    return format_rate(bytes_per_s, signed=True)


class _LiveView:
    """The table on a TTY: one row per process; cheap enough to redraw twice a second."""

    def __init__(self, sampler: Sampler, detector: MemoryGrowthDetector, pid: int) -> None:
        from rich.console import Console
        from rich.live import Live

        self.sampler = sampler
        self.detector = detector
        self.pid = pid
        self.console = Console()
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self._next_draw_s = 0.0
        self._next_growth_s = 0.0
        self._flagged: dict[int, growth.GrowthResult] = {}
        self._started_s = time.monotonic()

    def __enter__(self) -> "_LiveView":
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.draw(force=True)
        self.live.__exit__(*exc)

    def draw(self, force: bool = False) -> None:
        now_s = time.monotonic()
        if not force and now_s < self._next_draw_s:
            return
        self._next_draw_s = now_s + LIVE_REFRESH_S
        if force or now_s >= self._next_growth_s:
            self._next_growth_s = now_s + LIVE_GROWTH_EVERY_S
            self._flagged = {}
            for pid in self.detector.pids():
                for memory_class in ("anon", "pinned", "gpu", "rss"):
                    result = self.detector.growth(pid, memory_class)
                    if result is not None:
                        self._flagged[pid] = result
                        break
        self.live.update(self._table(), refresh=True)

    def _table(self) -> Any:
        from rich import box
        from rich.table import Table

        elapsed = time.monotonic() - self._started_s
        table = Table(
            title=f"kvdoctor watch {self.pid} · {self.sampler.rounds} samples · {format_duration(elapsed)} · Ctrl-C to stop",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
        )
        tracked_all = list(self.sampler.processes.values())
        pids = [t.info.pid for t in tracked_all]
        show_pinned = any(self.detector.latest(p, "pinned") for p in pids)
        show_gpu = any(self.detector.latest(p, "gpu") is not None for p in pids)
        compact = self.console.width < 100
        trend_width = 8 if compact else 16
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
        for tracked in tracked_all:
            pid = tracked.info.pid
            times, rss = self.detector.series(pid, "rss")
            recent = [i for i, t in enumerate(times) if t >= times[-1] - LIVE_RATE_WINDOW_S] if times else []
            rate = None
            if len(recent) >= 5:
                est = growth.theil_sen([times[i] for i in recent], [rss[i] for i in recent], max_points=120)
                rate = est.slope if est is not None else None
            flagged = self._flagged.get(pid)
            shown_rate = flagged.bytes_per_s if flagged is not None else rate
            tto = growth.time_to_oom_s(in_use, shown_rate, limit) if shown_rate else None
            cells = [str(pid), display_title(tracked.info.title), _bytes(self.detector.latest(pid, "rss")),
                     _bytes(self.detector.latest(pid, "anon"))]
            cells += [_bytes(self.detector.latest(pid, "pinned"))] if show_pinned else []
            cells += [_bytes(self.detector.latest(pid, "gpu"))] if show_gpu else []
            cells += [
                _sparkline(rss[-48:], width=trend_width),
                _rate_text(shown_rate) + (" !" if flagged is not None else ""),
                format_duration(tto) if tto is not None else "—",
            ]
            table.add_row(*cells, style="bold red" if flagged is not None else "")
        return table


def display_title(title: str) -> str:
    return short_title(title) or "?"


def _process_summaries(sampler: Sampler, detector: MemoryGrowthDetector) -> list[dict[str, Any]]:
    out = []
    for tracked in sampler.tracked():
        info = tracked.info
        last = tracked.last or {}
        out.append(
            {
                **info.to_dict(),
                "samples": tracked.samples,
                "exited": info.pid not in sampler.processes,
                "rss_bytes": last.get("rss_bytes"),
                "anon_bytes": last.get("rss_anon_bytes"),
                "shmem_bytes": last.get("rss_shmem_bytes"),
                "pinned_bytes": detector.latest(info.pid, "pinned"),
                "gpu_bytes": last.get("gpu_bytes"),
                "peak_rss_bytes": tracked.peak_rss_bytes,
            }
        )
    return out


def _text_summary(
    pid: int, trace_path: str, sampler: Sampler, elapsed_s: float, findings: list[Finding],
    processes: list[dict[str, Any]], out: TextIO,
) -> None:
    print(
        f"kvdoctor watch {pid}: {len(processes)} process(es), {sampler.rounds} samples over "
        f"{format_duration(elapsed_s)}; trace: {trace_path}",
        file=out,
    )
    for proc in processes:
        state = "exited" if proc["exited"] else "running"
        print(
            f"  {proc['pid']:>7}  {proc['role']:<11} rss {_bytes(proc['rss_bytes']):>9} "
            f"(peak {_bytes(proc['peak_rss_bytes'])})  {state:<7} {display_title(proc['title'])[:60]}",
            file=out,
        )
    if not findings:
        print("no memory growth found", file=out)
        return
    for finding in findings:
        print(f"{finding.severity.upper()} {finding.kind}: {finding.message}", file=out)


def watch(
    pid: int,
    interval_s: float = 1.0,
    duration_s: float | None = None,
    trace_path: str | None = None,
    output_format: str = "auto",
    attach: bool = False,
    *,
    growth_params: growth.GrowthParams | None = None,
    prometheus: str | None = None,
    prometheus_public: bool = False,
) -> int:
    """Samples `pid` and its descendants until `duration_s`, Ctrl-C or the root's exit.

    `growth_params` tunes the growth test (warm-up, windows, minimum rate); the defaults suit
    watches of minutes to days. `prometheus` ("HOST:PORT") serves the live metrics there while the
    watch runs (see kvdoctor.prometheus). Returns 0 without error findings, 1 with, 2 if nothing
    was sampled.
    """
    if output_format not in OUTPUT_FORMATS:
        raise KvdoctorError(f"unknown format {output_format!r}", "use one of: " + ", ".join(OUTPUT_FORMATS))
    if not (interval_s > 0):
        raise KvdoctorError(f"--interval must be a positive number of seconds, not {interval_s}")
    if duration_s is not None and not (duration_s > 0):
        raise KvdoctorError(f"--duration must be a positive number of seconds, not {duration_s}")
    check_process(pid)
    prometheus_address = None
    if prometheus is not None:
        from kvdoctor.reporters.prometheus import parse_address

        prometheus_address = parse_address(prometheus, public=prometheus_public)
    probe_tail = None
    attribution = HostGrowthAttributionDetector()
    if attach:
        from kvdoctor.commands.attach import attach_for_watch
        from kvdoctor.trace.reader import TraceTail

        probe_trace = attach_for_watch(pid, os.path.abspath(trace_path) if trace_path else default_trace_path(pid))
        probe_tail = TraceTail(probe_trace, frozenset({schema.HOST_GROWTH_SITES, schema.PROBE_STATUS})) if probe_trace else None
    detector = MemoryGrowthDetector(growth_params)
    sampler = Sampler(pid, interval_s=interval_s)
    live_view: _LiveView | None = None
    if output_format != "json" and sys.stdout.isatty():
        live_view = _LiveView(sampler, detector, pid)
    writer, path, owned = _open_trace(trace_path, pid)
    header = schema.header_event(
        pid=os.getpid(),
        engine="",
        engine_version="",
        process_title=f"kvdoctor watch {pid}",
        extra={
            "command": "watch",
            "root_pid": pid,
            "interval_s": interval_s,
            "duration_s": duration_s,
            "memory_limit_bytes": sampler.memory_limit_bytes,
            "started_at_us": now_us(),
        },
    )
    header.name = schema.RUN_HEADER
    header.cat = schema.CAT_SAMPLER
    writer.write_batch([header])
    detector.feed(header)

    def on_round(events: list[schema.Event]) -> None:
        if probe_tail is not None:
            attached = probe_tail.poll()
            for event in attached:
                attribution.feed(event)
                if event.name == schema.HOST_GROWTH_SITES and live_view is None:
                    for finding in attribution.findings():
                        if finding.pid == event.pid:
                            print(f"kvdoctor: {finding.message}", file=sys.stderr)
            events = events + attached
        if events:
            writer.write_batch(events)
            for event in events:
                detector.feed(event)
        if exporter is not None:
            exporter.feed(events)
            if time.monotonic() >= next_findings_s[0]:
                next_findings_s[0] = time.monotonic() + max(LIVE_GROWTH_EVERY_S, interval_s)
                exporter.set_findings(detector.findings() + attribution.findings())
        if live_view is not None:
            live_view.draw()

    exporter = None
    next_findings_s = [0.0]
    if prometheus_address is not None:
        from kvdoctor.reporters.prometheus import PrometheusExporter

        try:
            exporter = PrometheusExporter(*prometheus_address).start()
        except KvdoctorError:
            writer.close()
            if owned:
                finish_trace(path, os.getpid())
            raise
        print(f"kvdoctor: Prometheus metrics on {exporter.url}", file=sys.stderr)

    stop = threading.Event()
    previous_handler = None
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        previous_handler = signal.signal(signal.SIGINT, lambda _s, _f: stop.set())
    started_s = time.monotonic()
    try:
        if live_view is not None:
            with live_view:
                sampler.run(duration_s, stop=stop, on_round=on_round)
        else:
            sampler.run(duration_s, stop=stop, on_round=on_round)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous_handler if previous_handler is not None else signal.SIG_DFL)
        if exporter is not None:
            exporter.stop()
    elapsed_s = time.monotonic() - started_s
    if stop.is_set():
        print("kvdoctor: interrupted; analysing what was sampled", file=sys.stderr)
    elif not sampler.root_alive:
        print(f"kvdoctor: pid {pid} exited; analysing what was sampled", file=sys.stderr)

    if probe_tail is not None:
        for event in probe_tail.poll():
            attribution.feed(event)
            writer.write_batch([event])
    findings = detector.findings() + attribution.findings()
    writer.write_batch(
        [schema.Event(ph="i", name=schema.FINDING, pid=f.pid, ts=now_us(), cat=schema.CAT_ANALYSIS, args=f.to_dict()) for f in findings]
    )
    writer.close()
    if owned:
        finish_trace(path, os.getpid())

    processes = _process_summaries(sampler, detector)
    samples = sum(p["samples"] for p in processes)
    if output_format == "json" or (output_format == "auto" and live_view is None):
        report = {
            "findings": [f.to_dict() for f in findings],
            "trace": path,
            "samples": sampler.rounds,
            "duration_s": elapsed_s,
            "root_exited": not sampler.root_alive,
            "processes": processes,
        }
        print(json.dumps(report, default=str))
    else:
        _text_summary(pid, path, sampler, elapsed_s, findings, processes, sys.stdout)
    if samples == 0:
        print(f"kvdoctor: pid {pid} exited before it could be sampled; trace: {path}", file=sys.stderr)
        return EXIT_UNUSABLE
    return EXIT_FINDINGS if any(f.severity == ERROR for f in findings) else EXIT_OK

