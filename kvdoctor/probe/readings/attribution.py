"""Which Python code, and which thread, the host memory growth comes from.

Started by the probe when `KVDOCTOR_ATTRIBUTION=1` is set (or at attach). Every `period_s` it
opens a short window of `window_s`: tracemalloc on with ONE frame per allocation (its cost grows
with the depth), a snapshot at the start and at the end, tracemalloc off again. The difference,
grouped by file:line, gives the sites whose retained memory grew in the window. Both snapshots
are dumped beside the trace (`<trace>.tracemalloc.<pid>.<n>`, the last few kept) for
`tracemalloc.Snapshot.load` and `compare_to` outside the server.

tracemalloc cannot say which thread made an allocation. So, during the window, every thread's
stack is sampled a few times a second with `sys._current_frames()`, and each growing site is
credited to the threads seen running the function that contains its line (the innermost code
object whose line range contains it), split by how often each was seen there. A thread that
allocates in a function it spends almost no time in can be missed (no samples); a function run
by several threads is split between them by time, not by bytes. The event says so.

tracemalloc sees only memory allocated through Python's allocators: torch tensor storage,
pinned host buffers and other native allocations are invisible to it. The event counts the CPU
torch tensors held directly by the objects the probe already knows (the hooked allocators and
the radix tree); a full `gc.get_objects()` walk would stall a server and is not done.

Nothing here raises into the host: a failure stops attribution and emits a `probe_status` event
with component "attribution".
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
import threading
import time
import tracemalloc
from types import FrameType
from typing import Any

from kvdoctor.probe.base.callsites import short_path
from kvdoctor.probe.base.settings import DAY_S, env_count, env_number
from kvdoctor.trace import schema

ENV_ATTRIBUTION = "KVDOCTOR_ATTRIBUTION"
PROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kvdoctor/probe, never named as the host's
ENV_PERIOD_S = "KVDOCTOR_ATTRIBUTION_PERIOD_S"
ENV_WINDOW_S = "KVDOCTOR_ATTRIBUTION_WINDOW_S"
ENV_SAMPLE_HZ = "KVDOCTOR_ATTRIBUTION_SAMPLE_HZ"
ENV_TOP = "KVDOCTOR_ATTRIBUTION_TOP"

DEFAULT_PERIOD_S = 30.0
DEFAULT_WINDOW_S = 5.0
DEFAULT_SAMPLE_HZ = 5.0
DEFAULT_TOP = 10
KEEP_SNAPSHOT_FILES = 8  # the newest dumps kept beside the trace
MAX_STACK_DEPTH = 128
MAX_CODES = 20_000  # code objects remembered per window (memory bound)
TRACEMALLOC_FRAMES = 1

METHOD = (
    "tracemalloc (1 frame) diff over the window, grouped by file:line; each site credited to the "
    "threads whose sampled stacks (sys._current_frames at sample_hz) ran the function containing "
    "that line, split by sample count"
)
NOT_SEEN = (
    "tracemalloc sees only allocations made through Python's allocators: torch tensor storage, "
    "pinned host buffers and other native allocations are not in these numbers"
)


def _status(probe: Any, state: str, reason: str) -> None:
    try:
        probe.emitter.emit(schema.PROBE_STATUS, {"component": "attribution", "state": state, "reason": reason})
    except Exception:
        pass


class Attribution:
    def __init__(self, probe: Any) -> None:
        self.probe = probe
        # bounded below and above: a 1e-9 s period or a 1e9 Hz sampler would take the GIL from the server
        self.period_s = env_number(ENV_PERIOD_S, DEFAULT_PERIOD_S, low=0.1, high=DAY_S)
        self.window_s = min(env_number(ENV_WINDOW_S, DEFAULT_WINDOW_S, low=0.05, high=DAY_S), self.period_s)
        self.sample_hz = env_number(ENV_SAMPLE_HZ, DEFAULT_SAMPLE_HZ, low=0.01, high=1000.0)
        self.top = env_count(ENV_TOP, DEFAULT_TOP, high=1000)
        self.stop = threading.Event()
        self.windows = 0
        self.snapshot_index = 0
        self.dumped: list[str] = []
        self.thread: threading.Thread | None = None
        self.own_idents: set[int] = set()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kvdoctor-attribution", daemon=True)
        self.thread.start()
        _status(self.probe, "on", f"a {self.window_s:g} s tracemalloc window every {self.period_s:g} s")

    def _run(self) -> None:
        self.own_idents.add(threading.get_ident())
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                args = self.window()
                if args is not None:
                    self.probe.emitter.emit(schema.HOST_GROWTH_SITES, args)
            except Exception as exc:
                _status(self.probe, "off", f"{type(exc).__name__}: {exc}; host growth attribution stopped")
                return
            self.stop.wait(max(0.0, self.period_s - (time.monotonic() - began)))

    # ----- one window -----

    def window(self) -> dict[str, Any] | None:
        ours = not tracemalloc.is_tracing()
        if ours:
            tracemalloc.start(TRACEMALLOC_FRAMES)
        try:
            before = self._snapshot()
            codes: dict[Any, dict[str, int]] = {}
            samples = self._sample_threads(codes)
            after = self._snapshot()
            traced_bytes, peak_bytes = tracemalloc.get_traced_memory()
            overhead_bytes = tracemalloc.get_tracemalloc_memory()
        finally:
            if ours:
                tracemalloc.stop()
        self.windows += 1
        paths = [self._dump(before), self._dump(after)]
        stats = after.compare_to(before, "lineno")
        del before, after
        ranges: dict[str, list[tuple[Any, int, int]]] = {}
        for code in codes:
            first, last = _line_range(code)
            ranges.setdefault(code.co_filename, []).append((code, first, last))
        growing = [s for s in stats if s.size_diff > 0]
        by_thread: dict[str, float] = {}
        sites: list[dict[str, Any]] = []
        for stat in growing:
            frame = stat.traceback[0]
            threads = _threads_for(frame.filename, frame.lineno, codes, ranges)
            total = sum(threads.values())
            for name, count in threads.items():
                by_thread[name] = by_thread.get(name, 0.0) + stat.size_diff * count / total
            if not threads:
                by_thread["(not seen in samples)"] = by_thread.get("(not seen in samples)", 0.0) + stat.size_diff
            if len(sites) < self.top:
                best = max(threads, key=lambda name: threads[name]) if threads else ""
                sites.append(
                    {
                        "site": f"{short_path(frame.filename)}:{frame.lineno}",
                        "file": frame.filename,
                        "line": frame.lineno,
                        "size_diff_bytes": stat.size_diff,
                        "count_diff": stat.count_diff,
                        "size_bytes": stat.size,
                        "thread": best,
                        "threads": {name: round(count / total, 3) for name, count in sorted(threads.items(), key=lambda kv: -kv[1])[:8]}
                        if total
                        else {},
                    }
                )
        args: dict[str, Any] = {
            "engine": "tracemalloc",
            "window_index": self.windows,
            "window_s": self.window_s,
            "period_s": self.period_s,
            "tracemalloc_frames": TRACEMALLOC_FRAMES,
            "tracemalloc_was_on": not ours,
            "growth_bytes": sum(s.size_diff for s in growing),
            "traced_bytes": traced_bytes,
            "traced_peak_bytes": peak_bytes,
            "tracemalloc_overhead_bytes": overhead_bytes,
            "top_sites": sites,
            "by_thread": [
                {"thread": name, "size_diff_bytes": int(size)} for name, size in sorted(by_thread.items(), key=lambda kv: -kv[1])[:16]
            ],
            "thread_samples": samples,
            "sample_hz": self.sample_hz,
            "method": METHOD,
            "not_seen": NOT_SEEN,
            "torch_tensors": torch_tensors_known_to(self.probe),
            "snapshots": [p for p in paths if p],
        }
        if importlib.util.find_spec("memray") is not None:
            args["memray_command"] = f"memray attach {os.getpid()}"
            args["memray_note"] = "memray also sees native allocations (torch's CPU allocator, malloc); run it from a shell when needed"
        return args

    def _snapshot(self) -> tracemalloc.Snapshot:
        snapshot = tracemalloc.take_snapshot()
        return snapshot.filter_traces(
            [
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, os.path.join(PROBE_DIR, "*")),  # the probe's own allocations, every floor of it
                tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
            ]
        )

    def _sample_threads(self, codes: dict[Any, dict[str, int]]) -> int:
        interval_s = 1.0 / self.sample_hz
        end = time.monotonic() + self.window_s
        samples = 0
        while True:
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, top in sys._current_frames().items():
                if ident in self.own_idents:
                    continue
                name = names.get(ident, f"thread-{ident}")
                depth = 0
                seen: set[Any] = set()
                frame: FrameType | None = top
                while frame is not None and depth < MAX_STACK_DEPTH:
                    code = frame.f_code
                    if code not in seen:
                        seen.add(code)
                        counts = codes.get(code)
                        if counts is None and len(codes) < MAX_CODES:
                            counts = codes[code] = {}
                        if counts is not None:
                            counts[name] = counts.get(name, 0) + 1
                    frame = frame.f_back
                    depth += 1
                del frame
            samples += 1
            left = end - time.monotonic()
            if left <= 0 or self.stop.wait(min(interval_s, left)):
                return samples

    def _dump(self, snapshot: tracemalloc.Snapshot) -> str:
        base = getattr(self.probe, "trace_path", None)
        if not base:
            return ""
        stem = f"{base}.tracemalloc.{os.getpid()}"  # the pid: the processes of one trace never share a name
        partial = f"{stem}.partial-{self.snapshot_index}"
        try:  # what Snapshot.dump writes, but 0600 like the trace, and never through a link
            with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as fh:
                pickle.dump(snapshot, fh, pickle.HIGHEST_PROTOCOL)
        except OSError:
            try:
                os.remove(partial)
            except OSError:
                pass
            self.snapshot_index += 1
            return ""
        placed, self.snapshot_index = place_beside(partial, stem, self.snapshot_index)
        if placed is None:
            return ""
        path = placed
        self.dumped.append(path)
        while len(self.dumped) > KEEP_SNAPSHOT_FILES:
            old = self.dumped.pop(0)
            try:
                os.remove(old)
            except OSError:
                pass
        return path


def _line_range(code: Any) -> tuple[int, int]:
    lines = [line for _, _, line in code.co_lines() if line is not None]
    first = code.co_firstlineno
    return (min(lines + [first]), max(lines + [first]))


def _threads_for(
    filename: str, lineno: int, codes: dict[Any, dict[str, int]], ranges: dict[str, list[tuple[Any, int, int]]]
) -> dict[str, int]:
    """The sample counts per thread of the innermost sampled function that contains file:line."""
    best = None
    best_span = None
    for code, first, last in ranges.get(filename, ()):
        if first <= lineno <= last:
            span = last - first
            if best_span is None or span < best_span:
                best, best_span = code, span
    return dict(codes[best]) if best is not None else {}


def torch_tensors_known_to(probe: Any) -> dict[str, Any]:
    """CPU torch tensors held directly by the hooked allocators and the radix tree (not a heap walk)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {"counted": False, "reason": "torch is not imported in this process"}
    owners = [getattr(ledger, "host", None) for ledger in list(getattr(probe, "ledgers", {}).values())]
    owners.append(getattr(probe, "tree", None))
    owners = [o for o in owners if o is not None]
    if not owners:
        return {"counted": False, "reason": "the probe holds no engine objects yet (no hooked allocator or tree)"}
    storages: dict[int, tuple[int, bool]] = {}
    count = 0
    for owner in owners:
        values = list(vars(owner).values()) if hasattr(owner, "__dict__") else []
        for value in values:
            items = value if isinstance(value, (list, tuple)) else list(value.values()) if isinstance(value, dict) else [value]
            for item in list(items)[:1024]:
                if isinstance(item, torch.Tensor) and item.device.type == "cpu":
                    count += 1
                    try:
                        storage = item.untyped_storage()
                        storages[storage.data_ptr()] = (storage.nbytes(), bool(item.is_pinned()))
                    except Exception:
                        pass
    return {
        "counted": True,
        "method": "attributes of the hooked allocators and radix tree, one level deep (not every tensor in the process)",
        "count": count,
        "bytes": sum(n for n, _ in storages.values()),
        "pinned_bytes": sum(n for n, pinned in storages.values() if pinned),
    }


def place_beside(path: str, stem: str, index: int) -> tuple[str | None, int]:
    """Moves the finished file at `path` to `<stem>.<n>` for the first free n from `index` (the
    stem names the process, so the processes of one trace never share a name), and returns the
    name and the next n. It is linked there, so nothing already at a name (another process's
    capture, a file or a link someone put there) is ever replaced or followed; None when no name
    could be taken, the file removed."""
    for n in range(index, index + 16):
        name = f"{stem}.{n}"
        try:
            os.link(path, name)
        except FileExistsError:
            continue
        except OSError:
            break
        _remove(path)
        return name, n + 1
    _remove(path)
    return None, index + 1


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
