"""Putting the probe into a Python process that is already running, without a restart.

On Python 3.14 and newer this is `sys.remote_exec(pid, script)`: the interpreter runs the script
at its next safe point. On 3.10 to 3.13 gdb does it, the way memray's attach does: gdb stops the
process, sets breakpoints on the entry of `PyObject_Malloc` / `PyMem_Malloc` /
`PyErr_CheckSignals` (a thread that enters one of these holds the GIL, is not inside a system
call and holds no allocator lock), lets it run, and at the first hit calls
`PyGILState_Ensure`, `PyRun_SimpleString` and `PyGILState_Release`, then detaches. The Python
it runs only starts a new thread, so the target is stopped for milliseconds; that thread puts
kvdoctor's package root at the END of `sys.path` (it never shadows the host's modules), sets
`KVDOCTOR_TRACE` and calls `kvdoctor.probe.core.runtime.activate`, and reports back through a small
status file. SIGCONT is sent afterwards in case a debugger left the process stopped.

An attach is all-or-nothing on every signal: gdb and the attach's private directory belong to a
guard in a session of its own (kvdoctor/delivery/attach_inject.py, attach_guard.py), so a signal
to kvdoctor never ends gdb with its breakpoints still in the target, a cancel made before the
code went in leaves the target untouched however late gdb gets there, and no file is left behind,
even when kvdoctor is killed with SIGKILL.

Nothing is called at the point where gdb first stops the process: a call made while a thread
sits in a system call can corrupt the call's restart on some kernels. If gdb cannot run code in
the target (a gdb that cannot restore this CPU's extended register state, for example), the
process goes on untouched and `attach` says so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from kvdoctor import PACKAGE_ROOT
from kvdoctor.delivery.attach_code import INJECTED
from kvdoctor.delivery.attach_guard import PROBE_TOKEN, STATUS, read_exchange_file
from kvdoctor.delivery.attach_inject import (
    RUN_INSTEAD,
    AttachCancelled,
    CancelSignals,
    Injection,
    _Cancel,
    gdb_command,
    gdb_inject,
    remote_exec,
)
from kvdoctor.delivery.attach_target import target_python_version
from kvdoctor.delivery.attach_trace import create_probe_trace, drop_unwritten_trace
from kvdoctor.errors import KvdoctorError
from kvdoctor.probe.base.settings import env_number

GDB_TIMEOUT_S = 20.0  # how long gdb may wait for the target to reach a safe point (KVDOCTOR_ATTACH_WAIT_S)
ENV_ATTACH_WAIT_S = "KVDOCTOR_ATTACH_WAIT_S"
STATUS_TIMEOUT_S = 20.0  # how long the probe may take to import and start inside the target
CAP_SYS_PTRACE = 19


# --------------------------------------------------------------------------- what the target may do


def _read(path: str) -> str:
    with open(path, "rb") as fh:
        return fh.read().decode("utf-8", "replace")


def _capabilities() -> int:
    try:
        for line in _read("/proc/self/status").splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _is_descendant(pid: int) -> bool:
    me = os.getpid()
    for _ in range(64):
        try:
            fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
            pid = int(fields[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == me:
            return True
        if pid <= 1:
            return False
    return False


def ptrace_blocked_reason(pid: int | None = None) -> str | None:
    """Why this process may not ptrace `pid` (or any process when None), or None when it may."""
    has_cap = bool(_capabilities() & (1 << CAP_SYS_PTRACE))
    try:
        scope = int(_read("/proc/sys/kernel/yama/ptrace_scope").strip())
    except (OSError, ValueError):
        scope = 0
    if scope >= 3:
        return "ptrace is disabled on this machine (kernel.yama.ptrace_scope = 3; only a reboot lifts it)"
    if scope == 2 and not has_cap:
        return "only processes with CAP_SYS_PTRACE may attach here (kernel.yama.ptrace_scope = 2); run as root or grant CAP_SYS_PTRACE"
    if scope == 1 and not has_cap and (pid is None or not _is_descendant(pid)):
        return "kernel.yama.ptrace_scope = 1 lets a process attach only to its own children; run `sysctl kernel.yama.ptrace_scope=0` or grant CAP_SYS_PTRACE"
    if pid is not None:
        try:
            uid = int(_read(f"/proc/{pid}/status").split("Uid:", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            uid = os.geteuid()
        if uid != os.geteuid() and not has_cap:
            return f"pid {pid} belongs to another user (uid {uid}); run kvdoctor as the same user as the server, or as root with CAP_SYS_PTRACE"
    return None


def _remote_debug_disabled(pid: int) -> bool:
    try:
        environ = _read(f"/proc/{pid}/environ").split("\0")
        cmdline = _read(f"/proc/{pid}/cmdline").split("\0")
    except OSError:
        return False
    if any(v.startswith("PYTHON_DISABLE_REMOTE_DEBUG=") and v.split("=", 1)[1] for v in environ):
        return True
    return (
        any(cmdline[k] == "-X" and cmdline[k + 1] == "disable_remote_debug" for k in range(len(cmdline) - 1))
        or "-Xdisable_remote_debug" in cmdline
    )


# --------------------------------------------------------------------------- injection


def _gdb_inject(pid: int, injection: Injection, script_path: str, timeout_s: float) -> None:
    gdb_inject(pid, injection, script_path, timeout_s, ptrace_blocked_reason)


def _remote_exec(pid: int, script_path: str) -> None:
    remote_exec(pid, script_path, ptrace_blocked_reason)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def attach(
    pid: int,
    trace_path: str,
    fixes: Sequence[str] = (),
    *,
    attribution: bool | str = False,
    gdb_timeout_s: float | None = None,
    status_timeout_s: float = STATUS_TIMEOUT_S,
    force: bool = False,
    gdb_path: str | None = None,
) -> dict[str, Any]:
    """Starts the probe inside the running Python process `pid`, writing to `trace_path`, which
    is claimed as `run` claims its trace (`force` replaces a file there) and created first.

    `attribution` names the engine of the host growth windows (`auto`, `memray`, `tracemalloc`;
    True is `auto`). Returns what the probe reported from inside (`trace_path` it writes to, `already_active`
    when the process already ran under `kvdoctor run`). Raises KvdoctorError with one sentence
    when it cannot, and then the target is left as it was. `gdb_path`: the gdb to use (`--gdb`).
    """
    if not isinstance(pid, int) or pid <= 0 or not os.path.exists(f"/proc/{pid}"):
        raise KvdoctorError(f"no process with pid {pid}", "check the pid with `ps`")
    if gdb_timeout_s is None:  # an idle server may be given longer to reach a safe point
        gdb_timeout_s = env_number(ENV_ATTACH_WAIT_S, GDB_TIMEOUT_S, low=1.0, high=3600.0)
    if pid == os.getpid():
        raise KvdoctorError("kvdoctor cannot attach to itself", "give the pid of the server process")
    if _stopped(pid):
        raise KvdoctorError(
            f"pid {pid} is stopped (someone sent it SIGSTOP, or a debugger holds it): attaching would resume it",
            f"resume it yourself (kill -CONT {pid}) and attach again, or detach the debugger first",
        )
    version = target_python_version(pid)
    ours = sys.version_info[:2]
    if version != ours:
        raise KvdoctorError(
            f"pid {pid} runs Python {version[0]}.{version[1]} and this kvdoctor runs on Python {ours[0]}.{ours[1]}",
            f"run kvdoctor attach with a Python {version[0]}.{version[1]} install of kvdoctor, or " + RUN_INSTEAD,
        )
    if version < (3, 10):
        raise KvdoctorError(f"pid {pid} runs Python {version[0]}.{version[1]}; attach needs 3.10 or newer", RUN_INSTEAD)
    blocked = ptrace_blocked_reason(pid)
    if blocked:
        raise KvdoctorError(f"cannot attach to pid {pid}: {blocked}", RUN_INSTEAD)
    if version >= (3, 14) and _remote_debug_disabled(pid):
        raise KvdoctorError(
            f"cannot attach to pid {pid}: remote debugging is disabled in it (PYTHON_DISABLE_REMOTE_DEBUG or -X disable_remote_debug)",
            "restart it without that setting, or " + RUN_INSTEAD,
        )
    try:
        target_uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        raise KvdoctorError(f"no process with pid {pid}", "check the pid with `ps`") from None
    trace_path = create_probe_trace(trace_path, force=force, owner_uid=target_uid if os.geteuid() == 0 else os.geteuid())
    gdb = gdb_command(pid, gdb_path) if version < (3, 14) else None
    with CancelSignals() as cancel:
        injection = Injection(pid, gdb, cancel, trace_path)  # the guard drops the trace if nothing went in
        try:
            with injection:
                status = _inject(pid, injection, trace_path, fixes, attribution, gdb_timeout_s, status_timeout_s)
        except _Cancel:
            drop_unwritten_trace(trace_path)  # kept if the probe went in and wrote to it
            raise AttachCancelled(cancel.signum or signal.SIGTERM, pid, injection.outcome, trace_path) from None
        except BaseException:
            drop_unwritten_trace(trace_path)
            raise
    if not status.get("ok") or status.get("trace_path") != trace_path:
        drop_unwritten_trace(trace_path)  # the probe writes nothing there (it is off, or already writes elsewhere)
    if not status.get("ok"):
        raise KvdoctorError(
            f"the probe could not start inside pid {pid}: {status.get('error', 'unknown error')}",
            "the server's Python needs kvdoctor's dependencies (numpy), or " + RUN_INSTEAD,
        )
    return status


def _inject(
    pid: int,
    injection: Injection,
    trace_path: str,
    fixes: Sequence[str],
    attribution: bool | str,
    gdb_timeout_s: float,
    status_timeout_s: float,
) -> dict[str, Any]:
    """Puts the code in through `injection` and waits for the probe's status; raises `_Cancel` at
    any step once a cancelling signal came."""
    status_path = injection.exchange_path(STATUS)
    script_path = injection.path("inject.py")
    params = {
        "package_root": PACKAGE_ROOT,
        "trace_path": trace_path,
        "fixes": list(fixes),
        "status_path": status_path,
        "attribution": ("auto" if attribution is True else attribution or ""),
        "token": injection.exchange_path(PROBE_TOKEN),
    }
    with open(script_path, "w") as fh:
        fh.write(f"_KVDOCTOR_ATTACH_PARAMS = {json.dumps(json.dumps(params))}\n" + textwrap.dedent(INJECTED))
    os.chmod(script_path, 0o644)  # read by the target through the work directory it may only pass through
    with open(injection.exchange_path(PROBE_TOKEN), "w"):
        pass  # in the exchange, which the guard handed to the target's user: it may rename the token
    injection.check_cancel()
    if sys.version_info >= (3, 14):
        _remote_exec(pid, script_path)
    else:
        _gdb_inject(pid, injection, script_path, gdb_timeout_s)
        if injection.status:  # gdb went in just as it was stopped: the guard passed the status on
            return _parse_status(injection.status)
    deadline = time.monotonic() + status_timeout_s
    while not os.path.lexists(status_path):
        injection.check_cancel()
        if time.monotonic() > deadline:
            raise KvdoctorError(
                f"the probe did not report back from pid {pid} within {status_timeout_s:.0f} s",
                "look for kvdoctor events in the trace later, or " + RUN_INSTEAD,
            )
        if not os.path.exists(f"/proc/{pid}"):
            raise KvdoctorError(f"pid {pid} exited while the probe was starting", "check the server's log")
        time.sleep(0.05)
    status = _parse_status(read_exchange_file(status_path))
    return status


def _parse_status(text: str | None) -> dict[str, Any]:
    """The probe's status as the target wrote it; a file that is not a JSON object is a failure
    to report, not an error of kvdoctor's (the target's user could have put anything there)."""
    try:
        status = json.loads(text) if text is not None else None
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return {"ok": False, "error": "its status file was not the probe's report"}
    return status


# --------------------------------------------------------------------------- preflight


_PREFLIGHT: dict[str, str | None] = {}


def preflight() -> str | None:
    """None when attach works on this machine, else the reason (tests skip with it).

    Static checks first (gdb present, ptrace allowed), then one real attach to a throwaway child,
    which catches what only trying shows (seccomp, a gdb that cannot call functions here).
    """
    if "reason" in _PREFLIGHT:
        return _PREFLIGHT["reason"]
    reason: str | None = None
    if sys.version_info < (3, 14) and shutil.which("gdb") is None:
        reason = "gdb is not installed"
    else:
        reason = ptrace_blocked_reason(None)
    if reason is None:
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\nprint('ready', flush=True)\nwhile True:\n    x = [0] * 10\n    time.sleep(0.01)\n"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            child.stdout.readline()  # type: ignore[union-attr]
            reason = _try_injecting(child.pid)
        finally:
            child.kill()
            child.wait()
    _PREFLIGHT["reason"] = reason
    return reason


def _try_injecting(pid: int) -> str | None:
    """One real injection of a line that leaves a mark: None when the mark appears, else why not."""
    try:
        with CancelSignals() as cancel, Injection(pid, gdb_command(pid) if sys.version_info < (3, 14) else None, cancel) as injection:
            marker, script = injection.exchange_path("ran"), injection.path("p.py")
            with open(script, "w") as fh:
                fh.write(f"open({marker!r}, 'w').close()\n")
            if sys.version_info >= (3, 14):
                _remote_exec(pid, script)
            else:
                _gdb_inject(pid, injection, script, 15.0)
            deadline = time.monotonic() + 5
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            return None if os.path.exists(marker) else "the injected test code did not run in a throwaway child"
    except KvdoctorError as exc:
        return exc.message
    except _Cancel:
        raise KeyboardInterrupt from None


def attach_for_watch(pid: int, watch_trace_path: str, attribution: bool = True, *, force: bool = False) -> str | None:
    """Attaches for `watch --attach`: the probe's trace path (beside the watch's own, so the two
    pair up by name), or None after one line on stderr saying why the watch goes on from outside."""
    base = watch_trace_path[: -len(".kvtrace.json")] if watch_trace_path.endswith(".kvtrace.json") else watch_trace_path
    path = f"{base}.probe-{pid}.kvtrace.json"
    try:
        status = attach(pid, path, [], attribution=attribution, force=force)
    except AttachCancelled:
        raise  # the user's cancel is not "attach is not available"
    except KvdoctorError as exc:
        hint = f" ({exc.hint})" if exc.hint else ""
        print(f"kvdoctor: attach is not available for pid {pid}: {exc.message}{hint}; watching from outside", file=sys.stderr)
        return None
    written = status.get("trace_path") or path
    print(f"kvdoctor: probe attached to pid {pid}; its trace: {written}", file=sys.stderr)
    return str(written)
