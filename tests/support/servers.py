"""What the real-server tests share: a free port, a server's process tree, stopping it the way an
operator would (SIGINT, then SIGKILL to its session if it hangs), and its log."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(root_pid: int) -> dict[int, str]:
    """pid -> command line (or title) of every process below `root_pid`."""
    parent: dict[int, int] = {}
    titles: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                titles[int(entry)] = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out: dict[int, str] = {}
    frontier = {root_pid}
    while frontier:
        kids = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in out}
        for pid in kids:
            out[pid] = titles.get(pid, "")
        frontier = kids
    return out


def stop(proc: subprocess.Popen | None, log: IO[bytes] | None, timeout_s: float = 90.0) -> int | None:
    """SIGINT, as Ctrl-C would (kvdoctor run forwards it); SIGKILL to the session if it hangs, and
    to whatever of the session is still left afterwards."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            code = proc.wait(timeout=30)
    else:
        code = proc.returncode
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if log is not None:
        log.close()
    return code


def log_tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as fh:
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln for ln in data.splitlines() if "is ignored: it is neither a file" not in ln]
    return "\n".join(lines)[-n:]


class ServerRun:
    """What every real-server run has: its process, its log and the planted fault's report.
    Subclasses set `proc`, `_log`, `log_path`, `fault_out` and `stop_timeout_s`."""

    proc: subprocess.Popen | None = None
    _log: Any = None
    log_path = ""
    fault_out = ""
    returncode: int | None = None
    stop_timeout_s = 90.0

    def stop(self, timeout_s: float | None = None) -> int | None:
        self.returncode = stop(self.proc, self._log, self.stop_timeout_s if timeout_s is None else timeout_s)
        return self.returncode

    def log_tail(self, n: int = 4000) -> str:
        return log_tail(self.log_path, n)

    def fault(self) -> dict[str, Any] | None:
        try:
            with open(self.fault_out) as fh:
                return json.load(fh)
        except OSError:
            return None

    def fault_seen(self) -> dict[str, Any]:
        """The fault door's counts of the calls it saw (`-seen.json`): why a fault did not fire."""
        try:
            with open(self.fault_out[: -len(".json")] + "-seen.json") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}


def kvdoctor_json(*args: str, timeout_s: float = 300.0) -> tuple[int, dict[str, Any]]:
    """A kvdoctor command with JSON on stdout: its exit code and the parsed output."""
    proc = subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"kvdoctor {args[0]} gave no JSON (rc {proc.returncode}): {proc.stderr[-2000:]}") from None


def replay(trace: str) -> tuple[int, dict[str, Any]]:
    return kvdoctor_json("replay", trace, "--format", "json")


def wait_for(predicate, timeout_s: float, step_s: float = 0.5) -> bool:
    """Polls `predicate` until it holds or `timeout_s` has passed; its last answer."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()
