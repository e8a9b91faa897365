"""Sampling a live process tree's memory on a fixed interval, as trace events.

Each process of the tree (see kvdoctor.collect.procfs for what is read and how it is split by
class) gets a header event when first seen, then one MEMORY_COUNTER event per sample. The
pinned class costs a walk of /proc/PID/smaps, so it is read only every few samples and never
more often than a small CPU budget allows.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvdoctor.collect.nvml import NVML
from kvdoctor.collect.procfs import (
    ProcInfo,
    find_process_tree,
    guess_engine,
    machine_memory_limit_bytes,
    read_stat,
    sample_process,
    start_time_s,
)
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, now_us


@dataclasses.dataclass
class _Tracked:
    info: ProcInfo
    samples: int = 0
    last_pinned_bytes: int | None = None
    next_pinned_sample: int = 0
    next_pinned_time_s: float = 0.0
    last: dict[str, Any] | None = None
    peak_rss_bytes: int = 0
    said_title: str | None = None  # the title the last sample that carried one gave


class Sampler:
    """Samples a process tree every `interval_s` and emits trace events for what it reads.

    Each newly seen process gets a header event (the detectors key everything by pid), then one
    MEMORY_COUNTER event per sample. The tree is re-scanned every `tree_refresh_s`, so children
    that appear are picked up and exited ones dropped. `pinned_every_n`: read smaps at most every
    n samples of a process, and also no more often than keeps that reading under
    `pinned_cpu_fraction` of one core (smaps of a CUDA process is slow to produce).
    """

    def __init__(
        self,
        root_pid: int,
        *,
        interval_s: float = 1.0,
        emit: Callable[[list[schema.Event]], Any] | TraceWriter | None = None,
        pinned_every_n: int = 10,
        pinned_cpu_fraction: float = 0.005,
        tree_refresh_s: float = 2.0,
        with_gpu: bool = True,
        on_exec: Callable[[int], Any] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.root_pid = root_pid
        self.interval_s = interval_s
        if isinstance(emit, TraceWriter):
            writer = emit
            self._emit: Callable[[list[Any]], Any] | None = writer.write_batch
        else:
            self._emit = emit
        self.pinned_every_n = max(1, pinned_every_n)
        self.pinned_cpu_fraction = pinned_cpu_fraction
        self.tree_refresh_s = tree_refresh_s
        self.with_gpu = with_gpu
        self.on_exec = on_exec  # called with each process of the tree when first seen and when its title changes (an exec)
        self.memory_limit_bytes = machine_memory_limit_bytes(root_pid)
        self.processes: dict[int, _Tracked] = {}
        self.exited: dict[int, _Tracked] = {}
        self.rounds = 0
        self.root_alive = True
        self._next_tree_scan_s = 0.0

    def _refresh_tree(self, now_s: float) -> list[schema.Event]:
        events: list[schema.Event] = []
        tree = find_process_tree(self.root_pid)
        current = {p.pid: p for p in tree}
        for pid in list(self.processes):
            tracked = self.processes[pid]
            info = current.get(pid)
            if info is None or info.start_ticks != tracked.info.start_ticks:
                self.exited[pid] = self.processes.pop(pid)
        for pid, info in current.items():
            if pid in self.processes:
                known = self.processes[pid].info
                # setproctitle or an exec ran after we saw it; a command line gone empty is the process
                # exiting (a zombie's title is its comm), which is no exec and keeps the title it had
                if info.title and info.title != known.title and not info.argv_gone:
                    known.title, known.role = info.title, info.role
                    self._seen_exec(pid)
                continue
            self.processes[pid] = _Tracked(info=info)
            self._seen_exec(pid)
            start_s = start_time_s(info.start_ticks)
            header = schema.header_event(
                pid=pid,
                engine=guess_engine(info.title),
                engine_version="",
                process_title=info.title,
                extra={
                    "source": "sampler",
                    "ppid": info.ppid,
                    "role": info.role,
                    "root_pid": self.root_pid,
                    "process_start_s": start_s,
                    "memory_limit_bytes": self.memory_limit_bytes,
                },
            )
            header.cat = schema.CAT_SAMPLER
            events.append(header)
        self._next_tree_scan_s = now_s + self.tree_refresh_s
        return events

    def _seen_exec(self, pid: int) -> None:
        if self.on_exec is not None:
            try:
                self.on_exec(pid)
            except Exception:
                pass

    def sample_once(self) -> list[schema.Event]:
        """One round over the tree: returns (and emits) its header and counter events."""
        now_s = time.monotonic()
        events: list[schema.Event] = []
        if not self.processes or now_s >= self._next_tree_scan_s:
            events.extend(self._refresh_tree(now_s))
        if not self.processes:
            self.root_alive = False
            return events
        gpu_usage = NVML.usage_by_pid() if self.with_gpu else None
        ts_us = now_us()
        for pid in list(self.processes):
            tracked = self.processes[pid]
            due = tracked.samples >= tracked.next_pinned_sample and now_s >= tracked.next_pinned_time_s
            t0 = time.perf_counter()
            try:
                reading = sample_process(pid, with_pinned=due, gpu_usage=gpu_usage)
            except PermissionError:
                reading = sample_process(pid, with_pinned=False, gpu_usage=gpu_usage)
                due = False
                tracked.next_pinned_sample = 1 << 62  # smaps is closed to us: stop trying
            if reading is None:
                self.exited[pid] = self.processes.pop(pid)
                if pid == self.root_pid:
                    self.root_alive = False
                continue
            if due:
                cost_s = time.perf_counter() - t0
                tracked.last_pinned_bytes = reading["pinned_host_bytes"]
                tracked.next_pinned_sample = tracked.samples + self.pinned_every_n
                tracked.next_pinned_time_s = now_s + cost_s / max(self.pinned_cpu_fraction, 1e-6)
            tracked.samples += 1
            tracked.last = reading
            tracked.peak_rss_bytes = max(tracked.peak_rss_bytes, reading["rss_bytes"])
            args: dict[str, Any] = {
                "rss_bytes": reading["rss_bytes"],
                "anon_bytes": reading["rss_anon_bytes"],
                "shmem_bytes": reading["rss_shmem_bytes"],
                "file_bytes": reading["rss_file_bytes"],
                "swap_bytes": reading["swap_bytes"],
                "threads": reading["threads"],
            }
            # pinned is written only when freshly read: a counter track keeps its last value
            if due and reading["pinned_host_bytes"] is not None:
                args["pinned_bytes"] = reading["pinned_host_bytes"]
            if reading["gpu_bytes"] is not None:
                args["gpu_bytes"] = reading["gpu_bytes"]
                if reading["gpu_total_bytes"]:
                    args["gpu_total_bytes"] = reading["gpu_total_bytes"]
            if reading["open_files"] is not None:
                args["open_files"] = reading["open_files"]
            if reading["cpu_s"] is not None:
                args["cpu_s"] = reading["cpu_s"]
            if tracked.info.title != tracked.said_title:  # the title once, and again only when it changed
                args["title"] = tracked.said_title = tracked.info.title
            events.append(schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=pid, ts=ts_us, cat=schema.CAT_SAMPLER, args=args))
        if self.root_pid not in self.processes:
            self.root_alive = False
        self.rounds += 1
        if self._emit is not None and events:
            self._emit(events)
        return events

    def run(
        self,
        duration_s: float | None = None,
        *,
        stop: threading.Event | None = None,
        on_round: Callable[[list[schema.Event]], Any] | None = None,
    ) -> None:
        """Samples until `duration_s` passes, `stop` is set, or the root process exits.

        Rounds are scheduled on a fixed grid (start + k * interval), so slow rounds do not make
        the sampling drift; a round that falls behind skips to the next grid point.
        """
        start_s = time.monotonic()
        k = 0
        while True:
            events = self.sample_once()
            if on_round is not None:
                on_round(events)
            if not self.root_alive:
                return
            k += 1
            next_s = start_s + k * self.interval_s
            now_s = time.monotonic()
            if next_s < now_s:
                k = int((now_s - start_s) / self.interval_s) + 1
                next_s = start_s + k * self.interval_s
            if duration_s is not None and next_s - start_s > duration_s:
                return
            wait_s = next_s - now_s
            if stop is not None:
                if stop.wait(wait_s):
                    return
            else:
                time.sleep(wait_s)

    def still_running(self) -> list[ProcInfo]:
        """The processes it saw that run still (the same process: its start time matches, and it
        is no zombie). Asked after the command ended: what outlived it."""
        out = []
        for tracked in list(self.processes.values()) + list(self.exited.values()):
            stat = read_stat(tracked.info.pid)
            if stat is not None and stat[0] not in ("Z", "X") and stat[3] == tracked.info.start_ticks:
                out.append(tracked.info)
        return sorted(out, key=lambda info: info.pid)

    def tracked(self) -> Iterable[_Tracked]:
        """Every process seen so far, live ones first."""
        yield from self.processes.values()
        yield from self.exited.values()
