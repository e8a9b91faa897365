"""One attach's way in, all-or-nothing on every signal.

The attach's private directory and gdb belong to a guard process in a session of its own
(kvdoctor/delivery/attach_guard.py): a signal to kvdoctor never reaches gdb, and when kvdoctor is
done, cancelled or killed (even by SIGKILL: its pipe to the guard closes), the guard cancels what
has not happened yet, stops gdb only where that is safe, and removes the directory. kvdoctor
itself turns SIGINT, SIGTERM and SIGHUP into a cancel while it attaches: it tells the guard, waits
for it, and says what was left in the target (nothing, or a probe that had already started).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from kvdoctor.delivery import attach_guard
from kvdoctor.delivery.attach_code import gdb_script_for
from kvdoctor.delivery.attach_guard import GDB_TOKEN
from kvdoctor.errors import KvdoctorError

GUARD_PATH = os.path.abspath(attach_guard.__file__)
GUARD_START_S = 10.0  # the guard's time to start and make the directory
GUARD_FINISH_S = 120.0  # its time to stop gdb the safe way and clean up (bounded by its own limits)
CANCELLING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
RUN_INSTEAD = "start the server under `kvdoctor run --` instead"
GDB_SCRIPT_NAME = "attach.gdb"


class AttachCancelled(KvdoctorError):
    """The user cancelled the attach with a signal: the exit code is 128 + the signal's number."""

    def __init__(self, signum: int, pid: int, outcome: str, trace_path: str) -> None:
        name = signal.Signals(signum).name
        if outcome == "started":
            message = f"attach cancelled by {name} after the probe had started in pid {pid}: it stays on and writes {trace_path}"
        elif outcome in ("cancelled", "none"):
            message = f"attach cancelled by {name}: nothing was put into pid {pid}, which runs as before"
        else:  # a second signal: kvdoctor stopped waiting for its guard
            message = (
                f"attach cancelled by {name}; its guard finishes alone: it takes gdb out of pid {pid} the safe way "
                "and leaves it as it was, unless the probe had already started"
            )
        super().__init__(message)
        self.exit_code = 128 + signum


class CancelSignals:
    """While attaching, SIGINT/SIGTERM/SIGHUP are recorded instead of ending kvdoctor mid-way; the
    attach checks `signum` at each step. A signal ignored on entry stays ignored (nohup)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> CancelSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in CANCELLING_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Injection:
    """The guard and its directory, for one attach. Use as a context manager; `outcome` is set on exit."""

    def __init__(self, pid: int, gdb_command: list[str] | None, cancel: CancelSignals, trace_path: str = "") -> None:
        self.pid = pid
        self.cancel = cancel
        self.outcome = ""  # the guard's last word: cancelled, started or none
        self.status = ""  # the probe's status as the guard passed it on (JSON), if it had one
        self.output = ""  # what gdb wrote
        self._finished = False
        self._buffer = b""
        self._lines: list[str] = []
        command = [sys.executable, "-I", "-S", GUARD_PATH, str(pid)] + (["--trace", trace_path] if trace_path else [])
        command += ["--", *gdb_command] if gdb_command else []
        try:
            self.guard = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise KvdoctorError(f"cannot attach to pid {pid}: cannot start kvdoctor's attach guard ({exc.strerror})") from None
        said = self._next_said(GUARD_START_S, cancellable=False)
        if not said.startswith("workdir "):
            self.finish()
            raise KvdoctorError(f"cannot attach to pid {pid}: kvdoctor's attach guard did not start ({said or 'no answer'})")
        self.workdir, self.exchange = (str(part) for part in json.loads(said[len("workdir ") :]))

    def path(self, name: str) -> str:
        """A file of the attach's own, which only kvdoctor's user can write (gdb's script, its token,
        the code to inject)."""
        return os.path.join(self.workdir, name)

    def exchange_path(self, name: str) -> str:
        """A file the probe inside the target writes or renames (its token, its status)."""
        return os.path.join(self.exchange, name)

    def _read(self, timeout_s: float) -> bool:
        """Reads what the guard wrote within `timeout_s`; False at its end."""
        assert self.guard.stdout is not None
        ready, _, _ = select.select([self.guard.stdout], [], [], max(timeout_s, 0.0))
        if not ready:
            return True
        data = os.read(self.guard.stdout.fileno(), 65536)
        if not data:
            return False
        *complete, self._buffer = (self._buffer + data).split(b"\n")
        for raw in complete:
            line = raw.decode("utf-8", "replace")
            if line.startswith(attach_guard.SAY):
                self._lines.append(line[len(attach_guard.SAY) :])
            else:
                self.output += line + "\n"
        return True

    def _next_said(self, timeout_s: float, *, cancellable: bool = True) -> str:
        """The guard's next own line, "" at the deadline or its end; raises on a cancel."""
        deadline = time.monotonic() + timeout_s
        while not self._lines:
            if cancellable and self.cancel.signum is not None:
                raise _Cancel()
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.1)):
                return self._lines.pop(0) if self._lines else ""
        return self._lines.pop(0)

    def run_gdb(self, timeout_s: float) -> bool:
        """Lets gdb run; True when it ended within `timeout_s`. Raises `_Cancel` on a signal."""
        assert self.guard.stdin is not None
        self.guard.stdin.write(b"go\n")
        self.guard.stdin.flush()
        said = self._next_said(timeout_s)
        return said.startswith("gdb exited")

    def check_cancel(self) -> None:
        if self.cancel.signum is not None:
            raise _Cancel()

    def __enter__(self) -> Injection:
        return self

    def __exit__(self, _type: type[BaseException] | None, _value: BaseException | None, _tb: TracebackType | None) -> None:
        self.finish()

    def finish(self) -> None:
        """Closes the guard's stdin (done, or cancelled) and waits for its last word."""
        if self._finished:
            return
        self._finished = True
        try:
            if self.guard.stdin is not None:
                self.guard.stdin.close()
        except OSError:
            pass
        deadline = time.monotonic() + GUARD_FINISH_S
        while time.monotonic() < deadline and self.cancel.count < 2 and self._read(0.2):
            pass  # a second signal stops the wait: the guard finishes alone
        for line in self._lines:
            if line.startswith("done "):
                self.outcome = line[len("done ") :]
            elif line.startswith("status "):
                self.status = line[len("status ") :]
        try:
            self.guard.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass  # it goes on alone, and finishes its work


def gdb_command(pid: int, gdb_path: str | None = None) -> list[str]:
    """The gdb command line for `pid`: the gdb on PATH, or the one the user named (`--gdb`: a
    cuda-gdb where a GPU machine has no plain gdb, a newer gdb than the system's)."""
    if gdb_path:
        gdb = shutil.which(gdb_path)
        if gdb is None:
            raise KvdoctorError(
                f"cannot attach to pid {pid}: --gdb {gdb_path} is not an executable program",
                "name a gdb (or cuda-gdb) by its path, e.g. --gdb /usr/local/cuda/bin/cuda-gdb",
            )
    else:
        gdb = shutil.which("gdb")
    if gdb is None:
        raise KvdoctorError(
            f"cannot attach to pid {pid}: gdb is not installed (Python {sys.version_info[0]}.{sys.version_info[1]} has no sys.remote_exec)",
            "install gdb (`apt-get install gdb`), name one with --gdb PATH (a cuda-gdb does), or " + RUN_INSTEAD,
        )
    # the guard runs gdb in the attach's directory: the script is named relative to it
    return [
        gdb,
        "-batch",
        "-nx",
        "-nw",
        "-p",
        str(pid),
        "-iex",
        "set auto-solib-add off",
        "-iex",
        "set auto-load off",
        "-x",
        GDB_SCRIPT_NAME,
    ]


def gdb_inject(pid: int, injection: Injection, script_path: str, timeout_s: float, ptrace_reason: Callable[[int], str | None]) -> None:
    """Runs gdb (through the guard) until it put the code in, failed, or `timeout_s` passed; at the
    timeout the guard stops it the safe way. Raises KvdoctorError with the reason it failed."""
    with open(injection.path(GDB_SCRIPT_NAME), "w") as fh:
        fh.write(gdb_script_for(script_path, GDB_TOKEN))
    with open(injection.path(GDB_TOKEN), "w"):
        pass
    if injection.run_gdb(timeout_s):
        _raise_for_gdb_output(pid, injection.output, timeout_s, ptrace_reason, timed_out=False)
        return
    injection.finish()  # the guard stops gdb the safe way and says what it left
    if injection.outcome != "started":
        _raise_for_gdb_output(pid, injection.output.replace("KVDOCTOR: RAN", ""), timeout_s, ptrace_reason, timed_out=True)


def _raise_for_gdb_output(pid: int, output: str, timeout_s: float, ptrace_reason: Callable[[int], str | None], *, timed_out: bool) -> None:
    if "KVDOCTOR: RAN" in output:
        return
    if "ptrace: Operation not permitted" in output or "ptrace: " in output and "ptrace: No such process" not in output:
        reason = (
            ptrace_reason(pid)
            or "the kernel refused ptrace (a container without CAP_SYS_PTRACE, a seccomp profile, or another debugger already attached)"
        )
        raise KvdoctorError(f"cannot attach to pid {pid}: {reason}", RUN_INSTEAD)
    if "No such process" in output:
        raise KvdoctorError(f"no process with pid {pid}", "check the pid with `ps`")
    if "Couldn't write extended state" in output or "Couldn't get extended state" in output:
        raise KvdoctorError(
            f"cannot attach to pid {pid}: this gdb cannot call functions in a process on this CPU and kernel "
            "(it fails to restore the extended register state; the process was left untouched)",
            "try a newer gdb, or " + RUN_INSTEAD,
        )
    if 'No symbol "PyGILState_Ensure"' in output or 'No symbol "PyRun_SimpleString"' in output or "No symbol table" in output:
        raise KvdoctorError(f"cannot attach to pid {pid}: gdb finds no Python C API in it (a stripped or static interpreter)", RUN_INSTEAD)
    if "KVDOCTOR: the interpreter is shutting down" in output:
        raise KvdoctorError(
            f"cannot attach to pid {pid}: it is exiting (its interpreter was shutting down; nothing was run in it)",
            "to probe a process from its start, " + RUN_INSTEAD.replace("instead", "next time"),
        )
    if "KVDOCTOR: FAILED" in output:
        raise KvdoctorError(f"cannot attach to pid {pid}: the injected code raised inside it", RUN_INSTEAD)
    if timed_out or "KVDOCTOR: at a safe point" not in output:
        raise KvdoctorError(
            f"cannot attach to pid {pid}: it ran no Python code for {timeout_s:.0f} s (an idle interpreter never reaches a safe point; "
            "KVDOCTOR_ATTACH_WAIT_S waits longer)",
            "retry while the server handles requests, or " + RUN_INSTEAD,
        )
    last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
    raise KvdoctorError(f"cannot attach to pid {pid}: gdb failed ({last[0].strip()[:160]})", RUN_INSTEAD)


def remote_exec(pid: int, script_path: str, ptrace_reason: Callable[[int], str | None]) -> None:
    try:
        sys.remote_exec(pid, script_path)  # type: ignore[attr-defined]  # Python 3.14+
    except ProcessLookupError:
        raise KvdoctorError(f"no process with pid {pid}", "check the pid with `ps`") from None
    except PermissionError:
        reason = ptrace_reason(pid) or "the kernel refused to let this process read and write its memory"
        raise KvdoctorError(f"cannot attach to pid {pid}: {reason}", RUN_INSTEAD) from None
    except (RuntimeError, OSError) as exc:
        raise KvdoctorError(f"cannot attach to pid {pid}: sys.remote_exec failed ({exc})", RUN_INSTEAD) from None


class _Cancel(Exception):
    """Raised inside the attach when a cancelling signal was recorded; turned into AttachCancelled."""
