"""What a process kvdoctor is asked to attach to is: a kernel thread, a program that is not Python,
or a Python interpreter of some version, read from /proc before anything is put into it."""

from __future__ import annotations

import os
import re

from kvdoctor.delivery.attach_inject import RUN_INSTEAD
from kvdoctor.errors import KvdoctorError


def _read(path: str) -> str:
    with open(path, "rb") as fh:
        return fh.read().decode("utf-8", "replace")


PF_KTHREAD = 0x00200000  # the kernel's flag for its own threads, in /proc/PID/stat


def _kernel_thread_name(pid: int) -> str | None:
    """The name of kernel thread `pid` (kthreadd, kworker/0:1), or None when it is not one."""
    try:
        stat = _read(f"/proc/{pid}/stat")
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 1 :].split()
        return name if int(rest[6]) & PF_KTHREAD else None
    except (OSError, ValueError, IndexError):
        return None


def target_python_version(pid: int) -> tuple[int, int]:
    """The target's Python as (major, minor), from its executable and mapped files; fails if not Python."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except FileNotFoundError:
        kernel_thread = _kernel_thread_name(pid)
        if kernel_thread is not None:
            raise KvdoctorError(
                f"pid {pid} is a kernel thread ({kernel_thread}), not a Python process", "give the pid of the Python server process"
            ) from None
        raise KvdoctorError(f"no process with pid {pid}", "check the pid with `ps`") from None
    except PermissionError:
        raise KvdoctorError(f"not allowed to inspect pid {pid}", "run kvdoctor as the same user as the server, or as root") from None
    except OSError as exc:  # a kernel thread has no executable
        raise KvdoctorError(f"pid {pid} is not a Python process ({exc.strerror})", RUN_INSTEAD) from None
    try:
        maps = _read(f"/proc/{pid}/maps")
    except OSError:
        maps = ""
    exe_name = os.path.basename(exe.replace(" (deleted)", ""))
    found = re.search(r"libpython(\d)\.(\d+)", maps) or re.fullmatch(r"python(\d)\.(\d+)", exe_name)
    if found is None and (re.fullmatch(r"python\d?", exe_name) or "libpython" in maps):
        found = re.search(r"/lib/python(\d)\.(\d+)/", maps)
    if found is None:
        if re.fullmatch(r"python[\d.]*", exe_name) or "libpython" in maps:
            raise KvdoctorError(f"cannot tell which Python version pid {pid} runs ({exe})", RUN_INSTEAD)
        raise KvdoctorError(
            f"pid {pid} is not a Python process (it runs {exe})", "give the pid of the Python server process, or " + RUN_INSTEAD
        )
    if "libpython" not in maps and not _holds_python_api(f"/proc/{pid}/exe"):
        raise KvdoctorError(  # a program named like Python (a copy of `sleep` called python3.11) is none
            f"pid {pid} is not a Python process: it runs {exe}, whose name says Python but which has no Python C API",
            "give the pid of the Python server process, or " + RUN_INSTEAD,
        )
    return int(found.group(1)), int(found.group(2))


PYTHON_API_SYMBOL = b"PyRun_SimpleString\x00"  # what the injection calls: every interpreter exports it
EXE_SCAN_BYTES = 512 * 1024 * 1024


def _holds_python_api(path: str) -> bool:
    """Whether the executable at `path` (no libpython mapped: a statically linked interpreter, or
    not one at all) names the C API function the injection calls. Unreadable: assumed to."""
    tail = b""
    read = 0
    try:
        with open(path, "rb") as fh:
            while read < EXE_SCAN_BYTES:
                block = fh.read(1 << 20)
                if not block:
                    return False
                if PYTHON_API_SYMBOL in tail + block:
                    return True
                tail, read = block[-len(PYTHON_API_SYMBOL) :], read + len(block)
    except OSError:
        return True
    return True
