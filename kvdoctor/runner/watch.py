"""Watching a live server's process tree: the sampler, one Analyzer, the trace, and the extras.

Watching works from outside: /proc (and NVML for GPU memory) on a fixed interval, no ptrace and
nothing injected, so it is safe on a production server and needs only the server's user (or
root). The tree is followed: SGLang's scheduler and detokenizer or vLLM's engine core and
workers are sampled each on their own, and children that appear later are picked up.

Every event the watch writes to its trace (the run header, the sampler's headers and counters,
and with `attach` every event of the probe's own trace) is also fed to ONE `Analyzer` holding
every detector, so the findings of a watch are exactly those a `kvdoctor replay` of its trace
makes. Giving the watch the path of a trace that a `kvdoctor run` of the same server is still
writing appends to it (that trace is left for its owner to close); anything else at that path is
claimed as `run` claims its trace (kvdoctor.outputs.claim_output).

It stops at `duration_s`, on Ctrl-C, or when the watched process exits.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvdoctor.analysis import growth
from kvdoctor.analysis.analyzer import Analysis, Analyzer
from kvdoctor.analysis.detectors.host_growth_attribution import HostGrowthAttributionDetector
from kvdoctor.analysis.detectors.memory_growth import MemoryGrowthDetector
from kvdoctor.analysis.gate_growth import growth_by_process
from kvdoctor.collect.sampler import Sampler
from kvdoctor.delivery.attach import attach_for_watch
from kvdoctor.errors import KvdoctorError
from kvdoctor.formats.live.prometheus import PrometheusExporter
from kvdoctor.formats.live.summary import WatchResult
from kvdoctor.formats.live.view import LIVE_GROWTH_EVERY_S, LiveView, WatchStream, attribution_line
from kvdoctor.outputs import claim_output, remove_claimed
from kvdoctor.runner import default_trace_path
from kvdoctor.trace import schema
from kvdoctor.trace.reader import TraceTail
from kvdoctor.trace.writer import TraceWriter, finish_trace, now_us
from kvdoctor.units import format_rate

D = TypeVar("D")


def watch_analyzer(growth_params: growth.GrowthParams | None = None, host_memory_limit_bytes: int | None = None) -> Analyzer:
    """The analyzer a watch feeds: every detector, as `kvdoctor replay` runs them."""
    return Analyzer(growth_params=growth_params, host_memory_limit_bytes=host_memory_limit_bytes)


def _detector(analyzer: Analyzer, kind: type[D]) -> D:
    found = analyzer.detector(kind)
    if found is None:
        raise KvdoctorError(f"the watch's analyzer has no {kind.__name__}")
    return found


RUN_HEAD_BYTES = 64 * 1024  # a run header line, with a long command, fits


def trace_run_is_writing(resolved: str) -> bool:
    """Whether `resolved` is a trace that `kvdoctor run` started and has not ended: a regular file
    (not a link) whose first event is a run header of kvdoctor's schema, with no closing bracket.
    Read without following a link and without waiting on a FIFO."""
    try:
        if not stat.S_ISREG(os.lstat(resolved).st_mode):
            return False
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = fh.read(RUN_HEAD_BYTES).split(b"\n", 2)
        fh.seek(max(0, os.fstat(fd).st_size - 16))
        ended = fh.read().rstrip().endswith(b"]")
    if len(head) < 3 or head[0].strip() != b"[" or ended:
        return False
    try:
        first = json.loads(head[1].rstrip().rstrip(b","))
    except ValueError:
        return False
    args = first.get("args") if isinstance(first, dict) else None
    return (
        first.get("name") == schema.RUN_HEADER
        and isinstance(args, dict)
        and str(args.get("schema", "")).startswith(schema.SCHEMA_NAME + "/")
    )


def claim_trace(resolved: str, *, force: bool) -> bool:
    """Whether this watch owns (and so closes) the trace at `resolved`, once it may write there.

    A trace that `kvdoctor run` is still writing is appended to and left open for it; anything
    else at that path is claimed as `run` claims its trace: replaced only with `force`, never a
    device, FIFO or directory, a link replaced itself and never followed."""
    if trace_run_is_writing(resolved):
        return False
    claim_output(resolved, force=force, what="trace")
    try:
        remove_claimed(resolved)
    except OSError as exc:
        raise KvdoctorError(f"cannot write the trace {resolved}: {exc.strerror or exc}", "pass --trace to a writable place") from None
    return True


def open_trace(resolved: str) -> TraceWriter:
    try:
        return TraceWriter(resolved)
    except OSError as exc:
        raise KvdoctorError(f"cannot write the trace {resolved}: {exc.strerror or exc}", "pass --trace to a writable place") from None


def _run_header(pid: int, sampler: Sampler, interval_s: float, duration_s: float | None) -> schema.Event:
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
    return header


class WatchRecorder:
    """What happens to each round of samples: every event goes into the trace AND the analyzer
    (so a replay of the trace finds what the watch found), then to the extras."""

    def __init__(
        self,
        writer: TraceWriter,
        analyzer: Analyzer,
        probe_tail: TraceTail | None,
        exporter: PrometheusExporter | None,
        live_view: LiveView | None,
        findings_every_s: float,
    ) -> None:
        self.writer, self.analyzer, self.probe_tail = writer, analyzer, probe_tail
        self.exporter, self.live_view, self.findings_every_s = exporter, live_view, findings_every_s
        self.attribution = _detector(analyzer, HostGrowthAttributionDetector)
        self._next_findings_s = 0.0

    def record(self, events: list[schema.Event]) -> None:
        if events:
            batch: list[schema.Event | dict[str, Any]] = list(events)
            self.writer.write_batch(batch)
            for event in events:
                self.analyzer.feed(event)

    def probe_events(self) -> list[schema.Event]:
        """New events of the attached probe's trace (its end marker is not this trace's end)."""
        if self.probe_tail is None:
            return []
        return [e for e in self.probe_tail.poll() if e.name != schema.TRACE_END]

    def __call__(self, sampled: list[schema.Event]) -> None:
        attached = self.probe_events()
        events = sampled + attached
        self.record(events)
        if self.live_view is None:
            grown = {e.pid for e in attached if e.name == schema.HOST_GROWTH_SITES}
            for finding in self.attribution.findings() if grown else []:
                if finding.pid in grown:
                    print(attribution_line(finding), file=sys.stderr)
        if self.exporter is not None:
            self.exporter.feed(events)
            if time.monotonic() >= self._next_findings_s:
                self._next_findings_s = time.monotonic() + self.findings_every_s
                self.exporter.set_findings(self.analyzer.findings())
        if self.live_view is not None:
            self.live_view.draw()


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


def _sample_until_stopped(
    sampler: Sampler, duration_s: float | None, on_round: Callable[[list[schema.Event]], None], live_view: LiveView | None
) -> bool:
    """Runs the sampler (Ctrl-C stops it cleanly); True when it was interrupted."""
    stop = threading.Event()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda _s, _f: stop.set()) if in_main_thread else None
    try:
        if live_view is not None:
            with live_view:
                sampler.run(duration_s, stop=stop, on_round=on_round)
        else:
            sampler.run(duration_s, stop=stop, on_round=on_round)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    return stop.is_set()


def run_watch(
    pid: int,
    *,
    interval_s: float = 1.0,
    duration_s: float | None = None,
    trace_path: str | None = None,
    live: bool = False,
    attach: bool = False,
    growth_params: growth.GrowthParams | None = None,
    prometheus_address: tuple[str, int] | None = None,
    force: bool = False,
    stream: WatchStream | None = None,
) -> WatchResult:
    """Samples `pid` and its descendants until `duration_s`, Ctrl-C or the root's exit, and
    analyses everything it wrote. `live` draws the table (for a TTY); `growth_params` tunes the
    growth test (the defaults suit watches of minutes to days); `force` lets `trace_path` replace
    a file there; `stream` is told of each round (without the live table: lines as the watch goes)."""
    path = os.path.abspath(trace_path) if trace_path else default_trace_path("watch", pid)
    owned = claim_trace(path, force=force)  # before anything is put into the server
    probe_tail = None
    if attach:
        probe_trace = attach_for_watch(pid, path, force=force)  # the probe's trace is named after the watch's
        probe_tail = TraceTail(probe_trace, names=None) if probe_trace else None
    sampler = Sampler(pid, interval_s=interval_s)
    analyzer = watch_analyzer(growth_params, sampler.memory_limit_bytes)
    memory = _detector(analyzer, MemoryGrowthDetector)
    live_view = LiveView(sampler, memory, pid) if live else None
    writer = open_trace(path)
    on_round = WatchRecorder(writer, analyzer, probe_tail, None, live_view, max(LIVE_GROWTH_EVERY_S, interval_s))
    on_round.record([_run_header(pid, sampler, interval_s, duration_s)])
    exporter = None
    if prometheus_address is not None:
        try:
            exporter = on_round.exporter = PrometheusExporter(*prometheus_address).start()
        except KvdoctorError:
            writer.close()
            if owned:
                finish_trace(path, os.getpid())
            raise
        print(f"kvdoctor: Prometheus metrics on {exporter.url}", file=sys.stderr)
    started_s = time.monotonic()

    def sampled(events: list[schema.Event]) -> None:
        on_round(events)
        if stream is not None:
            stream.round(sampler.rounds, _process_summaries(sampler, memory), analyzer.findings)

    try:
        interrupted = _sample_until_stopped(sampler, duration_s, sampled, live_view)
    finally:
        if exporter is not None:
            exporter.stop()
    elapsed_s = time.monotonic() - started_s
    if interrupted:
        print("kvdoctor: interrupted; analysing what was sampled", file=sys.stderr)
    elif not sampler.root_alive:
        print(f"kvdoctor: pid {pid} exited; analysing what was sampled", file=sys.stderr)
    on_round.record(on_round.probe_events())
    analysis = analyzer.finish()
    findings = analysis.findings
    writer.write_batch(
        [schema.Event(ph="i", name=schema.FINDING, pid=f.pid, ts=now_us(), cat=schema.CAT_ANALYSIS, args=f.to_dict()) for f in findings]
    )
    writer.close()
    if owned:
        finish_trace(path, os.getpid())
    return WatchResult(
        root_pid=pid,
        trace_path=path,
        findings=findings,
        processes=_process_summaries(sampler, memory),
        rounds=sampler.rounds,
        elapsed_s=elapsed_s,
        root_exited=not sampler.root_alive,
        growth=growth_verdicts(analysis),
    )


def growth_verdicts(analysis: Analysis) -> dict[str, Any]:
    """Each process's growth verdict against the floor the watch's growth test uses, as the gate
    judges a budget: held, not judged, or not judged and gone before the watch's end."""
    budget = analysis.growth_budget_bytes_per_s
    if budget is None:
        return {}
    held, unjudged, gone = growth_by_process(analysis, budget, broken_apart=True)
    return {"budget": format_rate(budget, digits=1), "held": held, "not_judged": unjudged, "gone": gone}
