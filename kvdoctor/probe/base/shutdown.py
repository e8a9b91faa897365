"""A census in every engine process before the server kills it.

SGLang's launcher, told to stop (SIGINT or SIGTERM), ends its scheduler processes with SIGKILL
(`kill_process_tree`): no exit handler runs there, so the exit census never happens, and a CI job
that stops its server right after its benchmark is left with no census to judge. Under `kvdoctor
run` (and `gate`) every probed process shares a private directory (`KVDOCTOR_RENDEZVOUS`, made
and removed by `run`):

- a process that keeps a slot ledger registers there (`ledger.<pid>`);
- the launcher's probe, in front of the engine's kill (`shutdown_role.ShutdownRole`: SGLang's `kill_process_tree`,
  vLLM's `shutdown(procs)`, which sends SIGTERM and SIGKILLs what is left 5 s later), asks for a census (`census.request`) and
  waits until each registered process that is still alive has answered (`census.<pid>`), at most
  `KVDOCTOR_SHUTDOWN_CENSUS_WAIT_S` (5 s) in all, then lets the kill go on;
- each process answers from its writer thread: a census once its engine is quiet (no live request
  and no hooked call for one writer round), or, when it stays busy, its last rolling census with
  its age. A process that exits by itself answers with its exit census.

A process whose trace writer stopped (a full disk, a file size limit) cannot say so in the trace:
it leaves `writer-stopped.<pid>` there instead (an empty file's name needs no free block; the
reason goes in it when it fits), and `run` puts it in the trace's end event.

Without the directory (attach, a probe started by hand) nothing of this runs. Nothing here
raises: a directory that cannot be written only means no answer, and the kill goes on at the
deadline.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from kvdoctor.probe.base.settings import env_number

ENV_RENDEZVOUS = "KVDOCTOR_RENDEZVOUS"
ENV_WAIT_S = "KVDOCTOR_SHUTDOWN_CENSUS_WAIT_S"
DEFAULT_WAIT_S = 5.0  # the most the server's shutdown is held for the censuses, all processes together
MAX_WAIT_S = 60.0  # the most ENV_WAIT_S may ask for: a shutdown is never held longer
POLL_S = 0.05
REQUEST = "census.request"
WRITER_STOPPED = "writer-stopped."
# never through a link, and never blocked on a FIFO someone left at the name (O_NONBLOCK: ENXIO instead)
_PRIVATE_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK
MAX_WRITERS_STOPPED = 64  # read back by `run`: bounded like everything else it reads


def note_writer_stopped(error: str) -> None:
    """This process can no longer write its trace: said in the run's directory, never raising."""
    directory = os.environ.get(ENV_RENDEZVOUS, "")
    if not directory:
        return
    try:
        fd = os.open(os.path.join(directory, f"{WRITER_STOPPED}{os.getpid()}"), _PRIVATE_WRITE, 0o600)
    except OSError:
        return
    try:
        os.write(fd, error.encode("utf-8", "replace")[:500])
    except OSError:
        pass  # the name alone says it
    finally:
        os.close(fd)


def writers_stopped(directory: str) -> dict[int, str]:
    """pid -> why its trace writer stopped, as the processes of the run left it in `directory`."""
    out: dict[int, str] = {}
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(WRITER_STOPPED))
    except OSError:
        return out
    for name in names[:MAX_WRITERS_STOPPED]:
        pid = pid_of(name[len(WRITER_STOPPED) :])
        if pid is None:
            continue
        try:
            with open(os.path.join(directory, name), "rb") as fh:
                reason = fh.read(500).decode("utf-8", "replace")
        except OSError:
            reason = ""
        out[pid] = reason or "a write failed"
    return out


def pid_of(text: str) -> int | None:
    """The pid a rendezvous file's name ends with, or None: only ASCII digits (`²` and `٣` pass
    str.isdigit and fail int), and no more of them than a pid has."""
    return int(text) if 0 < len(text) <= 10 and text.isascii() and text.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:  # a zombie (killed, not yet reaped) answers nothing
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Rendezvous:
    """The run's shared directory, from either side."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._registered_pid = 0  # pids, not flags: a forked child is not registered by its parent
        self._answered_pid = 0
        self.asked_at_s: float | None = None  # monotonic time this process first saw the request
        self.asked_others = False  # this process asked already: the engine kills its tree more than once

    @property
    def registered(self) -> bool:
        return self._registered_pid == os.getpid()

    @property
    def answered(self) -> bool:
        return self._answered_pid == os.getpid()

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        directory = os.environ.get(ENV_RENDEZVOUS, "")
        return cls(directory) if directory and os.path.isdir(directory) else None

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _write(self, name: str, body: dict[str, Any]) -> bool:
        """Atomically (a reader never sees half a file); False when the directory is gone."""
        try:
            temp = self._path(f".{name}.{os.getpid()}")
            with os.fdopen(os.open(temp, _PRIVATE_WRITE, 0o600), "w") as fh:
                json.dump(body, fh)
            os.replace(temp, self._path(name))
            return True
        except OSError:
            return False

    # ----- an engine process -----

    def register(self) -> None:
        """This process keeps a ledger: the launcher waits for its census before killing it."""
        pid = os.getpid()
        if not self.registered and self._write(f"ledger.{pid}", {"pid": pid}):
            self._registered_pid = pid
            self.asked_at_s = None

    def asked(self) -> bool:
        if not self.registered or self.answered:
            return False
        if self.asked_at_s is None:
            if not os.path.exists(self._path(REQUEST)):
                return False
            self.asked_at_s = time.monotonic()
        return True

    def waited_s(self) -> float:
        return 0.0 if self.asked_at_s is None else time.monotonic() - self.asked_at_s

    def answer(self, census: str, **details: Any) -> None:
        pid = os.getpid()
        if self.registered and not self.answered and self._write(f"census.{pid}", {"pid": pid, "census": census, **details}):
            self._answered_pid = pid

    # ----- the launcher -----

    def ask_and_wait(self, wait_s: float | None = None) -> dict[str, Any]:
        """Asks every registered process for its census and waits for the live ones to answer."""
        self.asked_others = True
        if wait_s is None:
            wait_s = env_number(ENV_WAIT_S, DEFAULT_WAIT_S, high=MAX_WAIT_S)
        started = time.monotonic()
        if not self._write(REQUEST, {"pid": os.getpid(), "time_s": time.time()}):
            return {"asked": [], "answered": {}, "waited_s": 0.0, "unanswered": []}
        deadline = started + min(max(0.0, wait_s), MAX_WAIT_S)
        asked: list[int] = []
        answers: dict[int, dict[str, Any]] = {}
        while True:
            try:
                names = os.listdir(self.directory)
            except OSError:
                names = []
            asked = sorted(pid for n in names if n.startswith("ledger.") and (pid := pid_of(n[len("ledger.") :])) is not None)
            for pid in asked:
                if pid not in answers and f"census.{pid}" in names:
                    try:
                        with open(self._path(f"census.{pid}")) as fh:
                            answers[pid] = json.load(fh)
                    except (OSError, ValueError):
                        pass
            waiting = [pid for pid in asked if pid not in answers and pid != os.getpid() and _alive(pid)]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        return {
            "asked": asked,
            "answered": answers,
            "waited_s": round(time.monotonic() - started, 3),
            "unanswered": [pid for pid in asked if pid not in answers and pid != os.getpid() and _alive(pid)],
        }
