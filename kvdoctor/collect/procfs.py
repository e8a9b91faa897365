"""Reading a live process tree's memory from /proc, from outside (no ptrace, no code injected).

A serving process is a tree: SGLang's main process (tokenizer manager) with `sglang::scheduler`
and `sglang::detokenizer` children, vLLM's API server with `VLLM::EngineCore` and workers. A leak
lives in one of them and in one memory class, so each process is read on its own and its memory
is split by class:

    anon    RssAnon: malloc'd and Python heap memory, the usual leak
    shmem   RssShmem: shared memory (/dev/shm, shared anonymous, /dev/zero shared mappings)
    file    RssFile: mapped files (weights loaded with mmap, libraries)
    pinned  page-locked host memory from cudaHostAlloc, which shows as shared mappings of
            /dev/zero in /proc/PID/smaps (`rw-s ... /dev/zero (deleted)`, as PyTorch's
            pin_memory=True buffers do on CUDA 13), counted inside shmem as well
    gpu     device memory used by the process, from NVML (kvdoctor.collect.nvml)
    rss     VmRSS, the total of anon + file + shmem

Reading /proc/PID/status costs microseconds; /proc/PID/smaps walks every page table of the
process and can cost tens of milliseconds for a CUDA process, which is why the sampler reads the
pinned class only now and then.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from kvdoctor.collect.nvml import NVML
from kvdoctor.errors import KvdoctorError
from kvdoctor.trace import schema
from kvdoctor.trace.writer import redact_args

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Title fragments (lower case) SGLang and vLLM set with setproctitle, and the role each names.
ROLE_BY_TITLE = (
    ("sglang::scheduler", "scheduler"),
    ("sglang::detokenizer", "detokenizer"),
    ("sglang::tokenizer", "tokenizer"),
    ("vllm::enginecore", "engine"),
    ("vllm::worker", "worker"),
)


@dataclasses.dataclass
class ProcInfo:
    """One process of the watched tree, with the role its title suggests."""

    pid: int
    ppid: int
    title: str
    role: str
    start_ticks: int = 0
    argv_gone: bool = False  # its command line read empty (a kernel thread, or a process exiting): the title is "[comm]"

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "ppid": self.ppid, "title": self.title, "role": self.role}


def guess_role(title: str) -> str:
    """What a process does, from the title SGLang/vLLM give it with setproctitle."""
    lower = title.lower()
    for fragment, role in ROLE_BY_TITLE:
        if fragment in lower:
            return role
    first = lower.split(" ", 1)[0]
    if "python" in os.path.basename(first) or "python" in first:
        return "python"
    return "other"


def guess_engine(title: str) -> str:
    """The engine a process runs, from its title: the engine's own title (`sglang::scheduler`,
    `VLLM::EngineCore`), a `-m` module of its package, or its console script. Not any mention: a
    benchmark given `--tokenizer /models/sglang-tiny` is no SGLang process."""
    words = title.lower().split()
    for index, word in enumerate(words):
        if "::" in word:  # the title an engine gives its process (setproctitle: usually the only word)
            name = word.split("::", 1)[0]
        elif index and words[index - 1] == "-m":
            name = word.split(".", 1)[0]
        else:
            name = os.path.basename(word)
        if name in schema.SERVING_ENGINES:
            return name
    return ""


def read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None


def read_title(pid: int) -> str:
    """The command line as `ps` shows it: argv joined by spaces (setproctitle titles live here)."""
    raw = read_text(f"/proc/{pid}/cmdline")
    if raw is None:
        return ""
    title = " ".join(redact_args([part for part in raw.split("\0") if part])).strip()
    if not title:  # kernel threads and zombies have an empty cmdline
        comm = read_text(f"/proc/{pid}/comm")
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
    text = read_text(f"/proc/{pid}/stat")
    return _parse_stat(text) if text is not None else None


def _boot_time_s() -> float:
    text = read_text("/proc/stat") or ""
    for line in text.splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return time.time() - time.monotonic()


BOOT_TIME_S = _boot_time_s()


def start_time_s(start_ticks: int) -> float:
    """Wall-clock time (seconds since the epoch) of a start time read from /proc/PID/stat."""
    return BOOT_TIME_S + start_ticks / CLK_TCK


def process_start_s(pid: int) -> float | None:
    """Wall-clock start time of a process (seconds since the epoch), from /proc/PID/stat."""
    stat = read_stat(pid)
    return start_time_s(stat[3]) if stat is not None else None


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
        gone = title.startswith("[") and not read_text(f"/proc/{pid}/cmdline")
        out.append(ProcInfo(pid=pid, ppid=ppid, title=title, role=guess_role(title), start_ticks=start, argv_gone=gone))
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
    pid: int, *, with_pinned: bool = True, gpu_usage: dict[int, tuple[int, int]] | None | bool = True
) -> dict[str, Any] | None:
    """One reading of a process's memory, in bytes. None if the process is gone (or a zombie).

    `with_pinned` reads /proc/PID/smaps (expensive) for the pinned class; otherwise
    `pinned_host_bytes` is None. `gpu_usage`: True queries NVML here, a dict is a reading
    already taken for many pids, None/False skips the GPU. Raises PermissionError when the
    process belongs to someone we may not inspect.
    """
    text = read_text(f"/proc/{pid}/status")
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
        out["cpu_s"] = stat[2] / CLK_TCK
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
    text = read_text("/proc/meminfo") or ""
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
    cgroup_text = read_text(f"/proc/{proc}/cgroup") or ""
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
            limit = _parse_limit(read_text(os.path.join(directory, name)))
            if limit is not None:
                limits.append(limit)
    total = _mem_total_bytes()
    if limits:
        return min(limits + ([total] if total else []))
    return total


PF_KTHREAD = 0x00200000  # the kernel's flag for its own threads (/proc/PID/stat field 9)


def is_kernel_thread(pid: int) -> bool:
    """Kernel threads (kthreadd and its children) have no user memory and no command line."""
    stat_text = read_text(f"/proc/{pid}/stat")
    if not stat_text:
        return False
    try:
        flags = int(stat_text.rsplit(")", 1)[1].split()[6])
    except (IndexError, ValueError):
        return False
    return bool(flags & PF_KTHREAD)


def check_process(pid: int) -> None:
    """Fails with a one-line reason unless `pid` is a live process this user may inspect."""
    if not isinstance(pid, int) or pid <= 0:
        raise KvdoctorError(f"no process with pid {pid}", "check the pid with `ps`")
    status = None
    try:
        status = read_text(f"/proc/{pid}/status")
    except PermissionError:
        pass
    except OSError:
        status = None
    if status is None and not os.path.exists(f"/proc/{pid}"):
        raise KvdoctorError(f"no process with pid {pid}", "check the pid with `ps`")
    if status is not None:
        fields = _status_fields(status)
        state = fields.get("State", "")
        if state.startswith(("Z", "X")):
            raise KvdoctorError(f"pid {pid} has already exited (it is a zombie waiting for its parent)", "check the pid with `ps`")
        if is_kernel_thread(pid):
            raise KvdoctorError(f"pid {pid} is a kernel thread: it has no user memory to watch", "give the pid of the server (see `ps`)")
        uids = fields.get("Uid", "").split()
        euid = os.geteuid()
        if uids and euid != 0 and int(uids[0]) != euid:
            raise KvdoctorError(
                f"pid {pid} belongs to another user (uid {uids[0]}); its memory maps are closed to uid {euid}",
                "run kvdoctor as the same user as the server, or as root",
            )
    try:
        with open(f"/proc/{pid}/smaps", "rb") as fh:  # the access check happens at open
            fh.read(1)
    except PermissionError:
        raise KvdoctorError(
            f"not allowed to read the memory maps of pid {pid}", "run kvdoctor as the same user as the server, or as root"
        ) from None
    except (FileNotFoundError, ProcessLookupError):
        raise KvdoctorError(f"no process with pid {pid}", "check the pid with `ps`") from None
