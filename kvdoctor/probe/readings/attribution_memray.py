"""Host growth attribution with memray: torch's CPU tensors and other native allocations included.

tracemalloc sees only what goes through Python's allocators. torch's CPU tensor storage is
`posix_memalign`ed by its own allocator, so HiCache's host KV copies (sglang#19332) grow where
tracemalloc cannot look. memray hooks the C allocator itself (malloc, calloc, realloc,
posix_memalign, aligned_alloc, mmap, ...) and records the Python stack of each call, so its
windows name the Python file:line and the thread that allocated the growing native memory.

Same shape as the tracemalloc windows (kvdoctor/probe/readings/attribution.py, whose loop this reuses):
every `period_s`, a fresh `memray.Tracker` runs for `window_s` and writes one capture beside the
trace (`<trace>.memray.<pid>.<n>`, the newest few kept), in memray's aggregated format, whose size
follows the number of distinct stacks and not the number of allocations, so a server that runs
for days keeps a few small files. The window's growth is what memray calls leaks: allocations
made in the window and still alive at its end, grouped by the innermost Python frame and by
thread (memray records each allocation's thread; the names of threads started before the window
are handed to it when the window opens). Each capture opens with `memray flamegraph --leaks`,
`memray table` or `memray.FileReader` outside the server. A capture is private like the trace: it
is written in a 0700 directory beside the trace and moved into place 0600 once complete, and the
command line memray records in its header is the trace's, secrets redacted (memray reads
`sys.argv`; while a tracker is made, memray's module is shown a copy with the secrets as ***). A
capture whose header does not read back redacted is not kept.

Starting and stopping a tracker patches the allocator entries of every loaded library while
holding the GIL: with torch loaded, a pause of about 0.2 s at each end of a window
(bench/bench_attribution_memray.py), which is why windows are short and far apart.

Native stack unwinding (memray's `native_traces`) is not needed to see torch's allocations and
multiplies the cost; `KVDOCTOR_ATTRIBUTION_MEMRAY_NATIVE=1` adds the native frames to the capture
files for `memray flamegraph --native`.

Where memray is not installed, or another profiler holds `sys.setprofile` (memray's tracker would
replace it in every thread), the tracemalloc windows run instead and the probe_status line says
why. Nothing here raises into the host.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvdoctor.probe.base.callsites import short_path
from kvdoctor.probe.base.settings import env_switch
from kvdoctor.probe.readings.attribution import DEFAULT_TOP, Attribution, _remove, _status, place_beside
from kvdoctor.trace.writer import redact_args

ENV_NATIVE = "KVDOCTOR_ATTRIBUTION_MEMRAY_NATIVE"
ATTRIBUTION_BACKENDS = ("auto", "memray", "tracemalloc")  # what KVDOCTOR_ATTRIBUTION and --attribution-engine take
LEGACY_ON = ("1", "true", "yes", "on")  # KVDOCTOR_ATTRIBUTION=1 always meant the tracemalloc windows
KEEP_CAPTURE_FILES = 8
MEMORY_INTERVAL_MS = 1000  # memray's RSS samples inside a capture; the probe reads none of them
MAX_RECORDS = 50_000  # aggregated records read per window (memory bound on the reading side)
STACK_FRAMES = 4
NO_PYTHON_STACK = "(no Python stack)"
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kvdoctor/probe: every floor of the probe

METHOD = (
    "memray (the C allocator hooked: malloc, posix_memalign, mmap, ...; Python stacks) over the window: "
    "allocations made in the window and still alive at its end, grouped by the innermost Python file:line "
    "and by the thread that made them"
)
NOT_SEEN = (
    "memory allocated before the window and freed in it is not subtracted, so a window shows what was "
    "retained, not the net change; buffers alive only briefly past the window's end count as growth"
)


def engine_asked(value: str, *, force: bool = False) -> str | None:
    """The engine named by KVDOCTOR_ATTRIBUTION (None: attribution is off)."""
    value = value.strip().lower()
    if value in LEGACY_ON:
        return "tracemalloc"
    if value in ("", "0", "false", "no", "off"):
        return "tracemalloc" if force else None
    return value  # an unknown name is judged by worker_for, which says so in probe_status


def memray_unavailable_reason() -> str | None:
    """None when a memray window can run in this process, else why not (one clause)."""
    if not sys.platform.startswith("linux"):
        return f"memray windows run on Linux only (this is {sys.platform})"
    if importlib.util.find_spec("memray") is None:
        return "memray is not installed in this process's Python (pip install memray)"
    if sys.getprofile() is not None or getattr(threading, "_profile_hook", None) is not None:
        return "another profiler holds sys.setprofile, which memray's tracker would replace in every thread"
    return None


def worker_for(probe: Any, engine: str) -> Attribution:
    """The attribution worker for `engine` ("auto", "memray", "tracemalloc"), falling back to
    tracemalloc (with the reason in its probe_status line) where memray cannot run."""
    if engine == "tracemalloc":
        return Attribution(probe)
    if engine not in ATTRIBUTION_BACKENDS:
        return TracemallocFallback(probe, f"KVDOCTOR_ATTRIBUTION={engine!r} names no engine (auto, memray, tracemalloc)")
    reason = memray_unavailable_reason()
    if reason is None:
        return MemrayAttribution(probe)
    return TracemallocFallback(probe, reason)


class TracemallocFallback(Attribution):
    """The tracemalloc windows, started where memray was asked for (or `auto`) and cannot run."""

    def __init__(self, probe: Any, reason: str) -> None:
        super().__init__(probe)
        self.reason = reason

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kvdoctor-attribution", daemon=True)
        self.thread.start()
        _status(
            self.probe,
            "on",
            f"engine tracemalloc: a {self.window_s:g} s window every {self.period_s:g} s, instead of memray: {self.reason}; "
            "tracemalloc does not see torch tensor storage",
        )


class MemrayAttribution(Attribution):
    """A fresh memray tracker for `window_s` every `period_s`; one host_growth_sites event each."""

    def __init__(self, probe: Any) -> None:
        super().__init__(probe)
        self.native_traces = env_switch(ENV_NATIVE, False)
        self.captures: list[str] = []
        self.capture_index = 0
        self.scratch: str | None = None
        self.busy_windows = 0
        self.open_tracker: Any = None
        self.open_lock = threading.Lock()

    def start(self) -> None:
        atexit.register(self.remove_scratch)  # atexit runs last-in first-out: after close_window
        atexit.register(self.close_window, stopping=True)
        self.thread = threading.Thread(target=self._run, name="kvdoctor-attribution", daemon=True)
        self.thread.start()
        native = " with native frames" if self.native_traces else ""
        _status(
            self.probe,
            "on",
            f"engine memray: a {self.window_s:g} s window{native} every {self.period_s:g} s "
            "(sees native allocations: torch CPU tensors, malloc)",
        )

    def close_window(self, *, stopping: bool = False) -> None:
        """Stops the open tracker, from the window's thread, or at exit from the main thread (a
        tracker left running while the interpreter finalizes would outlive the objects it uses)."""
        with self.open_lock:
            if stopping:
                self.stop.set()
            tracker, self.open_tracker = self.open_tracker, None
            if tracker is not None:
                try:
                    tracker.__exit__(None, None, None)
                except Exception:
                    pass

    # ----- one window -----

    def window(self) -> dict[str, Any] | None:
        import memray

        path = os.path.join(self._scratch_dir(), "window.bin")
        argv_shown = redact_args(list(sys.argv))
        command_line = " ".join(argv_shown)
        with _memray_reads_argv(argv_shown) as redacted:
            tracker = memray.Tracker(
                destination=memray.FileDestination(path=path, overwrite=True),
                native_traces=self.native_traces,
                memory_interval_ms=MEMORY_INTERVAL_MS,
                file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS,
            )
        started_unix_s = time.time()
        with self.open_lock:
            if self.stop.is_set():
                return None
            try:
                tracker.__enter__()
            except RuntimeError as exc:  # another memray tracker is active (`memray attach`): skip this window
                self.busy_windows += 1
                if self.busy_windows == 1:
                    _status(self.probe, "paused", f"memray window skipped: {exc}; retried every {self.period_s:g} s")
                del tracker
                _remove(path)
                return None
            self.open_tracker = tracker
        try:
            _name_running_threads()
            self.stop.wait(self.window_s)
        finally:
            self.close_window()
        del tracker
        if self.stop.is_set():  # stopping (at exit): the capture is kept unread (no reader in a thread the exit may stop)
            self._keep(path, redacted)
            return None
        self.busy_windows = 0
        self.windows += 1
        try:
            args = self._read(memray, path)
        finally:
            kept = self._keep(path, redacted and _header_reads(memray, path, command_line))
        args["captures"] = [kept] if kept else []
        args["started_unix_s"] = round(started_unix_s, 3)
        return args

    def _read(self, memray: Any, path: str) -> dict[str, Any]:
        sites: dict[tuple[str, int], dict[str, Any]] = {}
        by_thread: dict[str, int] = {}
        growth_bytes = 0
        records = 0
        with memray.FileReader(path) as reader:
            for record in reader.get_leaked_allocation_records(merge_threads=False):
                records += 1
                if records > MAX_RECORDS:
                    break
                stack = record.stack_trace(max_stacks=STACK_FRAMES + 2)
                if stack and _is_ours(stack[0][1]):
                    continue
                size = int(record.size)
                thread = str(record.thread_name or "") or f"memray thread {record.tid}"
                growth_bytes += size
                by_thread[thread] = by_thread.get(thread, 0) + size
                key = (stack[0][1], int(stack[0][2])) if stack else (NO_PYTHON_STACK, 0)
                site = sites.get(key)
                if site is None:
                    site = sites[key] = {
                        "site": f"{short_path(key[0])}:{key[1]}" if stack else NO_PYTHON_STACK,
                        "file": key[0] if stack else "",
                        "line": key[1],
                        "function": stack[0][0] if stack else "",
                        "size_diff_bytes": 0,
                        "count_diff": 0,
                        "threads_bytes": {},
                        "stack": [f"{short_path(f)}:{ln} in {fn}" for fn, f, ln in stack[:STACK_FRAMES]],
                    }
                site["size_diff_bytes"] += size
                site["count_diff"] += int(record.n_allocations)
                site["threads_bytes"][thread] = site["threads_bytes"].get(thread, 0) + size
            peak_bytes = sum(int(r.size) for r in reader.get_high_watermark_allocation_records(merge_threads=True))
        top = sorted(sites.values(), key=lambda s: -int(s["size_diff_bytes"]))[: self.top if self.top > 0 else DEFAULT_TOP]
        for site in top:
            threads_bytes: dict[str, int] = site.pop("threads_bytes")
            total = sum(threads_bytes.values()) or 1
            ranked = sorted(threads_bytes.items(), key=lambda kv: -kv[1])
            site["thread"] = ranked[0][0] if ranked else ""
            site["threads"] = {name: round(size / total, 3) for name, size in ranked[:8]}
        return {
            "engine": "memray",
            "window_index": self.windows,
            "window_s": self.window_s,
            "period_s": self.period_s,
            "native_traces": self.native_traces,
            "growth_bytes": growth_bytes,
            "window_peak_bytes": peak_bytes,
            "records": min(records, MAX_RECORDS),
            "top_sites": top,
            "by_thread": [
                {"thread": name, "size_diff_bytes": size} for name, size in sorted(by_thread.items(), key=lambda kv: -kv[1])[:16]
            ],
            "method": METHOD,
            "not_seen": NOT_SEEN,
        }

    def _scratch_dir(self) -> str:
        """A private (0700) directory for the capture being written: beside the trace, so the
        finished capture moves into place without a copy; the system's temp dir without a trace."""
        if self.scratch is None:
            base = getattr(self.probe, "trace_path", None)
            try:
                self.scratch = tempfile.mkdtemp(prefix=".kvdoctor-memray-", dir=os.path.dirname(os.path.abspath(base)) if base else None)
            except OSError:
                self.scratch = tempfile.mkdtemp(prefix="kvdoctor-memray-")
        return self.scratch

    def remove_scratch(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _keep(self, path: str, redacted: bool) -> str | None:
        """Moves a finished capture beside the trace (`<trace>.memray.<pid>.<n>`, 0600; the newest
        KEEP_CAPTURE_FILES stay) and returns its path; without a trace, or unless its header
        carries the redacted command line, it is removed instead."""
        base = getattr(self.probe, "trace_path", None)
        if not base or not redacted:
            _remove(path)
            return None
        try:
            os.chmod(path, 0o600)
        except OSError:
            _remove(path)
            return None
        kept, self.capture_index = place_beside(path, f"{base}.memray.{os.getpid()}", self.capture_index)
        if kept is None:
            return None
        self.captures.append(kept)
        while len(self.captures) > KEEP_CAPTURE_FILES:
            _remove(self.captures.pop(0))
        return kept


class _ArgvShown:
    """What memray's module sees as `sys` while a tracker is made: the real module, but `argv`."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    def __getattr__(self, name: str) -> Any:
        return getattr(sys, name)


@contextlib.contextmanager
def _memray_reads_argv(argv: list[str]) -> Iterator[bool]:
    """memray writes `" ".join(sys.argv)` into a capture's header, secrets and all. Its extension
    module, and nothing else in the process, is shown `argv` instead for the time a tracker is
    made; the host's own `sys.argv` is never touched. Yields whether it could (False: a memray of
    another shape, whose captures are not kept)."""
    module = sys.modules.get("memray._memray")
    if module is None or getattr(module, "sys", None) is not sys:
        yield False
        return
    module.sys = _ArgvShown(argv)  # type: ignore[attr-defined]
    try:
        yield True
    finally:
        module.sys = sys  # type: ignore[attr-defined]


def _header_reads(memray: Any, path: str, command_line: str) -> bool:
    """Whether the capture at `path` carries exactly the redacted `command_line` in its header."""
    try:
        with memray.FileReader(path) as reader:
            return bool(reader.metadata.command_line == command_line)
    except Exception:
        return False


def _name_running_threads() -> None:
    """memray learns a thread's name when `Thread._name` is assigned while its tracker runs;
    threads started before the window are named again so their allocations carry the name."""
    for thread in threading.enumerate():
        try:
            thread._name = thread._name  # type: ignore[attr-defined]
        except Exception:
            pass


def _is_ours(filename: str) -> bool:
    return filename.startswith(_OWN_DIR) or f"{os.sep}memray{os.sep}" in filename
