"""Keeps one attach all-or-nothing, whatever happens to the kvdoctor that started it.

kvdoctor starts this script in a session of its own, so a signal meant for kvdoctor (a Ctrl-C,
`timeout`, a shell killing its job) never reaches gdb directly: gdb ended by a signal can leave
its breakpoints' int3 bytes in the target, which later dies of SIGTRAP. The guard makes the
attach's private directory, runs gdb when told to (a `go` line on its stdin), relays gdb's output,
and when kvdoctor is done or gone (its stdin closes; a SIGKILL of kvdoctor closes it too):

- takes the two tokens that stand for "not yet" (a rename: exactly one side gets each).
  `gdb-armed`: gdb's breakpoint takes it before calling into the target; if the guard got it
  first, gdb will not call, and a SIGINT to gdb is safe (gdb stops the target, removes its
  breakpoints and detaches). A SIGINT ends only the step gdb is in (while it attaches, gdb would
  go on to its script), so it is repeated until gdb is gone; gdb is killed only if it never got
  as far as its breakpoints. If gdb got it, gdb may be inside the call: it is never interrupted
  there, only waited for. `probe-armed`: the injected code takes it before it changes anything in
  the target; if the guard got it first, the code does nothing, however late it runs.
- waits for the probe's status when the injected code got there first, so nothing writes into the
  directory after it is removed;
- removes the directory (after passing on the probe's status, if any), and says `done cancelled`,
  `done started` or `done none`.

gdb also gets SIGINT from the kernel if the guard itself is killed (PR_SET_PDEATHSIG).
Standard library only: it runs with `python -I -S`.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

SAY = "KVDOCTOR-GUARD: "
GDB_TOKEN = "gdb-armed"
PROBE_TOKEN = "probe-armed"
TAKEN = ".taken"  # the injected code renames PROBE_TOKEN to this when it goes ahead
STATUS = "status.json"
EXCHANGE = "probe"  # the subdirectory the target's user may write: the probe's token and status
STATUS_MAX_BYTES = 65536
UNWRITTEN_TRACE = b"[\n"  # a trace kvdoctor created for the probe, before its first event
GDB_STOP_S = 15.0  # gdb's time to stop the target, remove its breakpoints and detach, under SIGINT
INTERRUPT_EVERY_S = 0.5  # a SIGINT ends only the step gdb is in (its attach, say): it is repeated
CONTINUING = b"KVDOCTOR: waiting for a safe point"  # printed just before the breakpoints go in
GDB_CALL_S = 60.0  # gdb's time to finish a call it is inside (never interrupted)
STATUS_WAIT_S = 20.0  # the probe's time to report once the injected code went ahead
PR_SET_PDEATHSIG = 1


class Guard:
    def __init__(self, pid: int, gdb_command: list[str]) -> None:
        self.pid = pid
        self.gdb_command = gdb_command
        self.workdir = tempfile.mkdtemp(prefix="kvdoctor-attach-")  # 0700
        try:
            self.exchange = make_exchange(self.workdir, pid)
        except OSError:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.gdb: subprocess.Popen[bytes] | None = None
        self.gdb_open = False
        self.continuing = False  # gdb may have breakpoints in the target: never SIGKILL it then
        self._tail = b""
        self.stopping = False

    def say(self, text: str) -> None:
        try:
            os.write(1, (SAY + text + "\n").encode("utf-8", "replace"))
        except OSError:
            pass  # kvdoctor is gone: the guard finishes its work all the same

    def relay(self, data: bytes) -> None:
        try:
            os.write(1, data)
        except OSError:
            pass

    def start_gdb(self) -> None:
        def stop_with_guard() -> None:
            try:
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0)
            except Exception:
                pass

        try:
            self.gdb = subprocess.Popen(
                self.gdb_command,  # its files are named relative to the directory
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=stop_with_guard,
            )
        except OSError as exc:
            self.say(f"gdb exited 127 ({exc.strerror})")
            return
        self.gdb_open = True

    def pump_gdb(self, timeout_s: float) -> None:
        """Relays what gdb wrote within `timeout_s`; on its end, says how it exited."""
        assert self.gdb is not None and self.gdb.stdout is not None
        ready, _, _ = select.select([self.gdb.stdout], [], [], timeout_s)
        if not ready:
            return
        data = os.read(self.gdb.stdout.fileno(), 65536)
        if data:
            self.continuing = self.continuing or CONTINUING in self._tail + data
            self._tail = data[-len(CONTINUING) :]
            self.relay(data)
            return
        self.gdb_open = False
        code = self.gdb.wait()
        try:
            os.kill(self.pid, signal.SIGCONT)  # in case a stop was left behind
        except OSError:
            pass
        self.say(f"gdb exited {code}")

    def serve(self) -> None:
        """Until kvdoctor closes stdin (or dies, or the guard is signalled)."""
        while not self.stopping:
            watched = [0] + ([self.gdb.stdout] if self.gdb_open and self.gdb and self.gdb.stdout else [])
            try:
                ready, _, _ = select.select(watched, [], [], 0.5)
            except OSError:
                return
            if 0 in ready:
                line = os.read(0, 1024)
                if not line:
                    return
                if b"go" in line and self.gdb is None and self.gdb_command:
                    self.start_gdb()
            if self.gdb_open and self.gdb and self.gdb.stdout in ready:
                self.pump_gdb(0)

    def take(self, name: str) -> bool:
        path = os.path.join(self.exchange if name == PROBE_TOKEN else self.workdir, name)
        try:
            os.rename(path, path + ".cancelled")
            return True
        except OSError:
            return False

    def wait_gdb(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.gdb_open and time.monotonic() < deadline:
            self.pump_gdb(0.2)

    def finish(self) -> str:
        probe_cancelled = self.take(PROBE_TOKEN)
        gdb_cancelled = self.take(GDB_TOKEN)
        if self.gdb is not None and self.gdb_open:
            if gdb_cancelled:  # it will not call into the target: interrupting it is safe
                deadline = time.monotonic() + GDB_STOP_S
                while self.gdb_open and time.monotonic() < deadline:
                    self.gdb.send_signal(signal.SIGINT)
                    self.wait_gdb(INTERRUPT_EVERY_S)
                if self.gdb_open and not self.continuing:  # stuck reading symbols, no breakpoint in: the last resort
                    self.gdb.kill()
            self.wait_gdb(GDB_CALL_S)
        taken = os.path.join(self.exchange, PROBE_TOKEN + TAKEN)
        deadline = time.monotonic() + STATUS_WAIT_S
        while os.path.lexists(taken) and not os.path.lexists(os.path.join(self.exchange, STATUS)):
            if time.monotonic() > deadline or not os.path.exists(f"/proc/{self.pid}"):
                break
            time.sleep(0.05)
        outcome = "cancelled" if probe_cancelled else "started" if os.path.lexists(taken) else "none"
        status = read_exchange_file(os.path.join(self.exchange, STATUS))
        if status is not None:
            self.say("status " + " ".join(status.split()))  # for a kvdoctor that stopped waiting for it
        shutil.rmtree(self.workdir, ignore_errors=True)
        return outcome


def make_exchange(workdir: str, pid: int) -> str:
    """The one place of the attach that the target's own user may write, inside `workdir`.

    gdb reads its command file and runs `shell` lines from `workdir`, as the user kvdoctor runs as.
    When root attaches to another user's process, that user must never be able to write there
    (renaming a file of their own over the command file would run their lines as root), yet the
    injected code, running as that user, must take its token and write its status. So `workdir`
    stays root's (0711: the target may pass through it to read the script, never list or write it)
    and only this subdirectory is handed to the target's user. Root never executes or follows a
    link in it: what it reads there is read by `read_exchange_file`.
    """
    exchange = os.path.join(workdir, EXCHANGE)
    os.mkdir(exchange, 0o700)
    try:
        target_uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return exchange  # gone: the attach fails on its own, nothing to hand over
    if os.geteuid() == 0 and target_uid != 0:
        os.chmod(workdir, 0o711)
        os.chown(exchange, target_uid, -1)
    return exchange


def read_exchange_file(path: str) -> str | None:
    """The text of a file the target's user may have written, or None: never through a link, never
    blocking on a FIFO or a device, at most STATUS_MAX_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, STATUS_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def drop_unwritten(trace_path: str) -> None:
    """The trace kvdoctor created for the probe, removed if the probe never wrote to it (an attach
    that ended before the probe started: kvdoctor may be gone, SIGKILLed, and cannot do it)."""
    try:
        st = os.lstat(trace_path)
        if stat.S_ISREG(st.st_mode) and st.st_size == len(UNWRITTEN_TRACE):
            os.remove(trace_path)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    pid = int(argv[0])
    trace_path = ""
    if len(argv) > 2 and argv[1] == "--trace":
        trace_path, argv = argv[2], argv[:1] + argv[3:]
    gdb_command = argv[2:] if len(argv) > 1 and argv[1] == "--" else []
    guard = Guard(pid, gdb_command)

    def stop(_signum: int, _frame: object) -> None:
        guard.stopping = True

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    outcome = "none"
    try:
        guard.say("workdir " + json.dumps([guard.workdir, guard.exchange]))  # one line whatever the temp dir is called
        guard.serve()
    finally:
        outcome = guard.finish()
        if trace_path and outcome != "started":
            drop_unwritten(trace_path)
        guard.say("done " + outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
