"""Sampling a live process tree's memory from /proc, from outside (no ptrace, no code injected).

A serving process is a tree: SGLang's main process (tokenizer manager) with `sglang::scheduler`
and `sglang::detokenizer` children, vLLM's API server with `VLLM::EngineCore` and workers. A leak
lives in one of them and in one memory class, so each process is sampled on its own and its
memory is split by class:

    anon    RssAnon: malloc'd and Python heap memory, the usual leak
    shmem   RssShmem: shared memory (/dev/shm, shared anonymous, /dev/zero shared mappings)
    file    RssFile: mapped files (weights loaded with mmap, libraries)
    pinned  page-locked host memory from cudaHostAlloc, which shows as shared mappings of
            /dev/zero in /proc/PID/smaps (`rw-s ... /dev/zero (deleted)`, as PyTorch's
            pin_memory=True buffers do on CUDA 13), counted inside shmem as well
    gpu     device memory used by the process, from NVML when it is installed and sees a GPU
    rss     VmRSS, the total of anon + file + shmem

Reading /proc/PID/status costs microseconds; /proc/PID/smaps walks every page table of the
process and can cost tens of milliseconds for a CUDA process, so the pinned class is read only
every few samples and never more often than a small CPU budget allows.

NVML reports host pids: inside a container with its own pid namespace, gpu memory may be missing.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, Iterable

from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, now_us

MEMORY_CLASSES = ("anon", "shmem", "file", "pinned", "gpu", "rss")

# The trace argument that carries each class in a MEMORY_COUNTER event.
CLASS_ARG = {
    "anon": "anon_bytes",
    "shmem": "shmem_bytes",
    "file": "file_bytes",
    "pinned": "pinned_bytes",
    "gpu": "gpu_bytes",
    "rss": "rss_bytes",
}

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclasses.dataclass
class ProcInfo:
    """One process of the watched tree, with the role its title suggests."""

    pid: int
    ppid: int
    title: str
    role: str
    start_ticks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "ppid": self.ppid, "title": self.title, "role": self.role}


def guess_role(title: str) -> str:
    """What a process does, from the title SGLang/vLLM give it with setproctitle."""
    lower = title.lower()
    if "sglang::scheduler" in lower:
        return "scheduler"
    if "sglang::detokenizer" in lower:
        return "detokenizer"
    if "sglang::tokenizer" in lower:
        return "tokenizer"
    if "vllm::enginecore" in lower:
        return "engine"
    if "vllm::worker" in lower:
        return "worker"
    first = lower.split(" ", 1)[0]
    if "python" in os.path.basename(first) or "python" in first:
        return "python"
    return "other"


def guess_engine(title: str) -> str:
    lower = title.lower()
    if "sglang" in lower:
        return "sglang"
    if "vllm" in lower:
        return "vllm"
    return ""


def _read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None


def read_title(pid: int) -> str:
    """The command line as `ps` shows it: argv joined by spaces (setproctitle titles live here)."""
    raw = _read_text(f"/proc/{pid}/cmdline")
    if raw is None:
        return ""
    title = " ".join(part for part in raw.split("\0") if part).strip()
    if not title:  # kernel threads and zombies have an empty cmdline
        comm = _read_text(f"/proc/{pid}/comm")
        title = f"[{comm.strip()}]" if comm else ""
    return title


def _parse_stat(text: str) -> tuple[str, int, int, int, int] | None:
    """(state, ppid, utime+stime ticks, start ticks, threads) from /proc/PID/stat."""
    close = text.rfind(")")
    if close < 0:
        return None
    rest = text[close + 2 :].split()
    if len(rest) < 20:
        return None
    try:
        return rest[0], int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[19]), int(rest[17])
    except ValueError:
        return None


def read_stat(pid: int) -> tuple[str, int, int, int, int] | None:
    text = _read_text(f"/proc/{pid}/stat")
    return _parse_stat(text) if text is not None else None


def _boot_time_s() -> float:
    text = _read_text("/proc/stat") or ""
    for line in text.splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return time.time() - time.monotonic()


_BOOT_TIME_S = _boot_time_s()


def process_start_s(pid: int) -> float | None:
    """Wall-clock start time of a process (seconds since the epoch), from /proc/PID/stat."""
    stat = read_stat(pid)
    if stat is None:
        return None
    return _BOOT_TIME_S + stat[3] / _CLK_TCK


def find_process_tree(root_pid: int) -> list[ProcInfo]:
    """The root and all its descendants, found from the ppid of every process in /proc.

    Returns an empty list if the root is gone. Order: root first, then breadth-first.
    """
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[str, int, int, int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        stat = read_stat(pid)
        if stat is None:
            continue
        stats[pid] = stat
        children.setdefault(stat[1], []).append(pid)
    if root_pid not in stats:
        return []
    out: list[ProcInfo] = []
    queue = [root_pid]
    seen = set()
    while queue:
        pid = queue.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        state, ppid, _cpu, start, _threads = stats[pid]
        if state in ("Z", "X") and pid != root_pid:
            continue
        title = read_title(pid)
        out.append(ProcInfo(pid=pid, ppid=ppid, title=title, role=guess_role(title), start_ticks=start))
        queue.extend(sorted(children.get(pid, [])))
    return out


def read_pinned_bytes(pid: int) -> int | None:
    """Sum of `Rss:` over mappings of /dev/zero in /proc/PID/smaps: how cudaHostAlloc shows.

    None if the process is gone. Raises PermissionError for a process we may not inspect.
    """
    try:
        with open(f"/proc/{pid}/smaps", "rb") as fh:
            data = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Scanning the bytes for the few /dev/zero headers is far cheaper than splitting every line.
    total_kib = 0
    idx = data.find(b" /dev/zero")
    while idx >= 0:
        line_start = data.rfind(b"\n", 0, idx) + 1
        if not data[line_start : line_start + 1].isupper():  # a mapping header, not a field
            rss_at = data.find(b"\nRss:", idx)
            if rss_at >= 0:
                end = data.find(b"\n", rss_at + 5)
                fields = data[rss_at + 5 : end if end >= 0 else len(data)].split()
                if fields and fields[0].isdigit():
                    total_kib += int(fields[0])
        idx = data.find(b" /dev/zero", idx + 10)
    return total_kib * 1024


class _Nvml:
    """NVML, initialised once; every failure turns into "no GPU data", never an exception."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._totals: list[int] = []

    def _init(self) -> None:
        self._tried = True
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            totals = [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
        except Exception:  # noqa: BLE001 - no library, no driver, no device: all mean "no data"
            return
        if handles:
            self._nvml, self._handles, self._totals = pynvml, handles, totals

    @property
    def available(self) -> bool:
        with self._lock:
            if not self._tried:
                self._init()
            return self._nvml is not None

    def usage_by_pid(self) -> dict[int, tuple[int, int]] | None:
        """pid -> (used bytes over all GPUs, total bytes of the GPUs it uses); None if no NVML."""
        if not self.available:
            return None
        out: dict[int, tuple[int, int]] = {}
        for handle, total in zip(self._handles, self._totals):
            procs: list[Any] = []
            for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                try:
                    procs.extend(getattr(self._nvml, name)(handle))
                except Exception:  # noqa: BLE001
                    continue
            seen: set[int] = set()
            for proc in procs:
                pid = int(getattr(proc, "pid", 0))
                if pid in seen:
                    continue
                seen.add(pid)
                used = getattr(proc, "usedGpuMemory", None)
                used_bytes = int(used) if isinstance(used, int) and used >= 0 and used < 1 << 60 else 0
                prev_used, prev_total = out.get(pid, (0, 0))
                out[pid] = (prev_used + used_bytes, prev_total + total)
        return out


NVML = _Nvml()


def _status_fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def _kib_bytes(fields: dict[str, str], key: str) -> int:
    value = fields.get(key, "0 kB").split()
    try:
        return int(value[0]) * 1024
    except (IndexError, ValueError):
        return 0


def sample_process(
    pid: int,
    *,
    with_pinned: bool = True,
    gpu_usage: dict[int, tuple[int, int]] | None | bool = True,
) -> dict[str, Any] | None:
    """One reading of a process's memory, in bytes. None if the process is gone (or a zombie).

    `with_pinned` reads /proc/PID/smaps (expensive) for the pinned class; otherwise
    `pinned_host_bytes` is None. `gpu_usage`: True queries NVML here, a dict is a reading
    already taken for many pids, None/False skips the GPU. Raises PermissionError when the
    process belongs to someone we may not inspect.
    """
    text = _read_text(f"/proc/{pid}/status")
    if text is None:
        return None
    fields = _status_fields(text)
    state = fields.get("State", "")
    if state.startswith(("Z", "X")) or "VmRSS" not in fields:
        return None  # exited (a zombie waiting to be reaped has no memory left)
    out: dict[str, Any] = {
        "pid": pid,
        "rss_bytes": _kib_bytes(fields, "VmRSS"),
        "rss_anon_bytes": _kib_bytes(fields, "RssAnon"),
        "rss_file_bytes": _kib_bytes(fields, "RssFile"),
        "rss_shmem_bytes": _kib_bytes(fields, "RssShmem"),
        "swap_bytes": _kib_bytes(fields, "VmSwap"),
        "threads": int(fields.get("Threads", "0") or 0),
        "pinned_host_bytes": None,
        "gpu_bytes": None,
        "gpu_total_bytes": None,
        "open_files": None,
        "cpu_s": None,
    }
    stat = read_stat(pid)
    if stat is not None:
        out["cpu_s"] = stat[2] / _CLK_TCK
    try:
        out["open_files"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        pass
    if with_pinned:
        pinned = read_pinned_bytes(pid)
        if pinned is None:
            return None
        out["pinned_host_bytes"] = pinned
    usage = NVML.usage_by_pid() if gpu_usage is True else (gpu_usage or None)
    if usage is not None:
        used, total = usage.get(pid, (0, 0))
        out["gpu_bytes"] = used
        out["gpu_total_bytes"] = total or None
    return out


def _parse_limit(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    # cgroup v1 reports "no limit" as a huge page-aligned number
    return value if 0 < value < (1 << 62) else None


def _mem_total_bytes() -> int | None:
    text = _read_text("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def machine_memory_limit_bytes(pid: int | None = None) -> int | None:
    """The memory a process may use before the OOM killer acts: its cgroup limit, else MemTotal.

    Looks at the cgroup of `pid` (default: this process), v2 `memory.max` then v1
    `memory.limit_in_bytes`, walking up the hierarchy since a parent's limit applies too.
    """
    proc = str(pid) if pid else "self"
    limits: list[int] = []
    cgroup_text = _read_text(f"/proc/{proc}/cgroup") or ""
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hier, controllers, path = parts
        if controllers == "":
            base, name = "/sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        path = path.strip("/")
        candidates = [base]
        if path:
            segs = path.split("/")
            candidates += [os.path.join(base, *segs[:k]) for k in range(1, len(segs) + 1)]
        for directory in candidates:
            limit = _parse_limit(_read_text(os.path.join(directory, name)))
            if limit is not None:
                limits.append(limit)
    total = _mem_total_bytes()
    if limits:
        return min(limits + ([total] if total else []))
    return total


@dataclasses.dataclass
class _Tracked:
    info: ProcInfo
    samples: int = 0
    last_pinned_bytes: int | None = None
    next_pinned_sample: int = 0
    next_pinned_time_s: float = 0.0
    last: dict[str, Any] | None = None
    peak_rss_bytes: int = 0


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
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.root_pid = root_pid
        self.interval_s = interval_s
        if isinstance(emit, TraceWriter):
            writer = emit
            self._emit: Callable[[list[schema.Event]], Any] | None = writer.write_batch
        else:
            self._emit = emit
        self.pinned_every_n = max(1, pinned_every_n)
        self.pinned_cpu_fraction = pinned_cpu_fraction
        self.tree_refresh_s = tree_refresh_s
        self.with_gpu = with_gpu
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
                if info.title and info.title != known.title:  # setproctitle ran after we saw it
                    known.title, known.role = info.title, info.role
                continue
            self.processes[pid] = _Tracked(info=info)
            start_s = _BOOT_TIME_S + info.start_ticks / _CLK_TCK
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
            args["title"] = tracked.info.title
            events.append(
                schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=pid, ts=ts_us, cat=schema.CAT_SAMPLER, args=args)
            )
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

    def tracked(self) -> Iterable[_Tracked]:
        """Every process seen so far, live ones first."""
        yield from self.processes.values()
        yield from self.exited.values()
