"""Starting a command with the probe in every Python process it starts.

The probe rides in through PYTHONPATH (a sitecustomize that activates it and then chains to the
host's own), so multiprocessing spawn children such as SGLang's scheduler carry it too; where
kvdoctor is installed in the server's own environment, its start-up hook (kvdoctor-autoprobe.pth,
asked for with KVDOCTOR_AUTOPROBE) brings it in even when a script replaced PYTHONPATH. A Python
process whose PYTHONPATH lost kvdoctor's directory is recorded at the trace's end (probe_path_lost),
so a verdict without a probe can say why. Every
process appends to one trace, and a sampler thread adds the memory of the command's process tree
from outside; when the command ends the trace is closed.

The command runs in a process group of its own, which `run` answers for: the signals `run` gets
(SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) are passed to the command's first process
(one that `run` was started ignoring, as under nohup, stays ignored for both), and when it ends,
what is left of its group is ended (SIGTERM, then SIGKILL after a grace period). If `run` itself
is killed with SIGKILL, the command's first process gets SIGKILL from the kernel (PR_SET_PDEATHSIG);
its own children are then its to end. The probes share a private directory for the run, where
the one in the server's launcher asks the others for a census before it kills them (SGLang ends its
schedulers with SIGKILL: `probe/base/shutdown.py`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import kvdoctor
from kvdoctor.collect.procfs import read_title
from kvdoctor.collect.sampler import Sampler
from kvdoctor.delivery import crash_boxes
from kvdoctor.delivery.rendezvous import new_rendezvous
from kvdoctor.errors import KvdoctorError
from kvdoctor.outputs import claim_output, remove_claimed
from kvdoctor.probe.base.shutdown import ENV_RENDEZVOUS, writers_stopped
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace, redact, redact_args

INJECT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pythonpath")  # holds sitecustomize.py alone
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
SAMPLER_JOIN_TIMEOUT_S = 5.0
GROUP_GRACE_S = 10.0  # what is left of the command's group gets this long after SIGTERM, then SIGKILL
PR_SET_PDEATHSIG = 1
ENV_AUTOPROBE = "KVDOCTOR_AUTOPROBE"  # read by kvdoctor/probe/core/entry.py (imported by the .pth only where it is set)
MAX_PATH_LOST = 8  # Python processes named in the trace whose PYTHONPATH lost kvdoctor's directory


def probe_environment(
    trace_path: str, fixes: list[str], base: dict[str, str] | None = None, attribution: str = "", rendezvous: str = ""
) -> dict[str, str]:
    """The environment that turns the probe on in every Python process started with it (and host
    growth attribution with the engine named, `auto`, `memray` or `tracemalloc`); `rendezvous`,
    the run's private directory where the probes answer a census asked for at shutdown."""
    env = dict(os.environ if base is None else base)
    if rendezvous:
        env[ENV_RENDEZVOUS] = rendezvous
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = INJECT_DIR + (os.pathsep + existing if existing else "")
    env["KVDOCTOR_TRACE"] = trace_path
    env["KVDOCTOR_PACKAGE_ROOT"] = kvdoctor.PACKAGE_ROOT
    env[ENV_AUTOPROBE] = "1"
    if fixes:
        env["KVDOCTOR_FIXES"] = ",".join(fixes)
    if attribution:
        env["KVDOCTOR_ATTRIBUTION"] = attribution
    return env


def start_trace(
    trace_path: str, command: list[str], extra: dict[str, Any] | None = None, *, force: bool = False, inputs: Sequence[str | None] = ()
) -> None:
    """A fresh trace holding only the run header: what ran (secrets redacted), for every process
    that appends later. An existing file is replaced only with `force`, and never a non-regular
    one or one of the command's `inputs` (gate's baseline)."""
    resolved = claim_output(trace_path, force=force, what="trace", inputs=inputs)
    remove_claimed(resolved)
    shown = redact_args(command)
    writer = TraceWriter(resolved)
    header = schema.header_event(
        pid=os.getpid(),
        engine="",
        engine_version="",
        process_title=redact("kvdoctor " + " ".join(shown))[:160],
        extra={"command": shown, **(extra or {})},
    )
    header.name = schema.RUN_HEADER
    writer.write_batch([header])
    writer.close()


def forwarded_signals() -> list[signal.Signals]:
    """The signals `run` passes on: those of FORWARDED_SIGNALS that `run` was not started ignoring.
    One ignored on entry stays ignored, and the command inherits that (`nohup kvdoctor run -- ...`
    keeps its server through a hang-up, as a shell's `trap` leaves such a signal alone)."""
    return [sig for sig in FORWARDED_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when `run` dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_group(pgid: int, grace_s: float = GROUP_GRACE_S) -> None:
    """Ends what is left of a process group: SIGTERM, a grace period, then SIGKILL."""
    if not _group_alive(pgid):
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


def probe_path_lost(pid: int) -> str | None:
    """What a Python process of the command lacks of what `run` gave it to load the probe
    ("PYTHONPATH" or "environment"), as the environment it was started with shows; '' when
    nothing; None when that cannot be read now (the process is gone or a zombie, whose exe and
    environment are closed) or it is no Python interpreter."""
    try:
        if not os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python"):
            return None
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read(1 << 20)
    except OSError:
        return None
    if not raw:  # a zombie's (or an exec's half-built) environment reads empty
        return None
    env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    if b"KVDOCTOR_TRACE" not in env:
        return "environment"
    paths = os.fsdecode(env.get(b"PYTHONPATH", b"")).split(os.pathsep)
    return "" if INJECT_DIR in {os.path.abspath(p) for p in paths if p} else "PYTHONPATH"


class ProbePathCheck:
    """The command's Python processes whose PYTHONPATH (or whole environment) lost what `run` set,
    checked as the sampler first sees each and again after an exec: {pid: {pid, title, lost}}.
    A process that can no longer be read (its exit changes its title too) keeps what was found."""

    def __init__(self) -> None:
        self.lost: dict[int, dict[str, Any]] = {}

    def __call__(self, pid: int) -> None:
        lost = probe_path_lost(pid)
        if lost is None:
            return
        if not lost:
            self.lost.pop(pid, None)
        elif pid in self.lost or len(self.lost) < MAX_PATH_LOST:
            self.lost[pid] = {"pid": pid, "title": redact(read_title(pid))[:120], "lost": lost}


def _start_sampler(
    pid: int, trace_path: str, interval_s: float, failures: list[str], on_exec: Callable[[int], Any] | None = None
) -> tuple[threading.Event, threading.Thread, Sampler]:
    """Samples the command's process tree from outside (memory by class) into the same trace, so
    growth is judged for every process, probed or not. A trace it cannot write to (a full disk)
    stops it, said in `failures`."""
    stop = threading.Event()
    writer = TraceWriter(trace_path)
    sampler = Sampler(pid, interval_s=interval_s, emit=writer, on_exec=on_exec)

    def loop() -> None:
        try:
            sampler.run(stop=stop)
        except OSError as exc:
            failures.append(f"the sampler stopped writing it: {exc.strerror or exc}")
        except Exception:
            pass  # the sampler never takes the run down with it
        finally:
            writer.close()

    thread = threading.Thread(target=loop, name="kvdoctor-sampler", daemon=True)
    thread.start()
    return stop, thread, sampler


MAX_OUTLIVED = 16  # leftover processes named in the trace and on stderr


def outlived(sampler: Sampler | None) -> list[dict[str, Any]]:
    """The processes of the command's tree that run on after it and the end of its group: they
    left the group (`setsid`, `setpgid`), so `run` did not end them. Said, not killed: a daemon
    may be meant to run on, and only its owner knows."""
    if sampler is None:
        return []
    return [{"pid": info.pid, "title": redact(info.title)[:120]} for info in sampler.still_running()[:MAX_OUTLIVED]]


def interpreter_of(path: str) -> str | None:
    """What would run the file: its `#!` line's program, else a guess from its name (.py, .sh),
    else None (a file that does not look like a program)."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(256)
    except OSError:
        first = b""
    if first.startswith(b"#!") and first[2:].split():
        words = first[2:].decode("utf-8", "replace").split()
        return words[1] if os.path.basename(words[0]) == "env" and len(words) > 1 else os.path.basename(words[0])
    return "python" if path.endswith(".py") else "sh" if path.endswith(".sh") else None


def _not_runnable(name: str) -> KvdoctorError:
    """Why `name` cannot be started, with what to do: not found, not executable, a directory, or
    a file here that is not on PATH."""
    path = name if os.sep in name else os.path.join(".", name)
    here = os.sep not in name and os.path.isfile(path)
    if os.sep in name or here:
        if os.path.isdir(path):
            return KvdoctorError(f"{name} is a directory, not a command", "give the program or script to run")
        if os.path.isfile(path) and not os.access(path, os.X_OK):
            interpreter = interpreter_of(path)
            through = f", or run it through its interpreter: `{interpreter} {path}`" if interpreter else ""
            return KvdoctorError(f"{name} is not executable", f"make it executable with `chmod +x {path}`{through}")
        if here:
            return KvdoctorError(f"command not found: {name} (a file of that name is here, but not on PATH)", f"give its path: ./{name}")
    return KvdoctorError(f"command not found: {name}", "check the spelling or give a full path")


def run_command(
    command: list[str],
    trace_path: str,
    fixes: list[str],
    sample_interval_s: float = 1.0,
    *,
    force: bool = False,
    attribution: str = "",
    inputs: Sequence[str | None] = (),
    on_start: Callable[[], None] | None = None,
) -> tuple[int, str]:
    """Runs `command` under the probe (and the sampler unless `sample_interval_s` is 0); returns
    its exit code (128 + N for a signal, as a shell reports it) and the trace's path. `on_start`
    runs once the command and the trace are known good, right before the command starts."""
    if not command:
        raise KvdoctorError("no command given", "usage: kvdoctor run [--trace PATH] -- CMD ...")
    if shutil.which(command[0]) is None:
        raise _not_runnable(command[0])
    trace_path = os.path.abspath(trace_path)
    try:
        start_trace(trace_path, command, {"fixes": fixes}, force=force, inputs=inputs)
    except OSError as exc:
        raise KvdoctorError(f"cannot write the trace {trace_path}: {exc.strerror}", "pass --trace to a writable place") from None
    child: subprocess.Popen[bytes] | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        # To the command's first process only: a server shuts its workers down in its own order
        # (SGLang's scheduler ends badly on a SIGINT of its own). The rest of the group is ended
        # once that process is gone. A signal before the command exists is passed on once it does.
        if child is None:
            pending.append(signum)
            return
        try:
            child.send_signal(signum)
        except OSError:
            pass

    # in place before the command starts: a signal meeting Python's own handler (a KeyboardInterrupt
    # between the start and here) would leave the command's group and the sampler running
    previous = {sig: signal.signal(sig, forward) for sig in forwarded_signals()}
    sampling = None
    failures: list[str] = []  # what could not be written to the trace
    paths = ProbePathCheck()
    rendezvous = new_rendezvous()  # 0700, named by run's pid: a SIGKILLed run's is removed by the next
    try:
        if on_start is not None:
            on_start()
        try:
            child = subprocess.Popen(
                command,
                env=probe_environment(trace_path, fixes, attribution=attribution, rendezvous=rendezvous),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise KvdoctorError(f"cannot start {command[0]}: {exc.strerror}") from None
        for signum in pending:
            forward(signum, None)
        sampling = _start_sampler(child.pid, trace_path, sample_interval_s, failures, paths) if sample_interval_s > 0 else None
        try:
            code = child.wait()
        finally:
            end_group(child.pid)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if sampling is not None:
            sampling[0].set()
            sampling[1].join(timeout=SAMPLER_JOIN_TIMEOUT_S)
        stopped = writers_stopped(rendezvous)
        boxes = crash_boxes.collect(rendezvous)  # what the ledgers counted, read before the directory goes
        shutil.rmtree(rendezvous, ignore_errors=True)
    code = code if code >= 0 else 128 - code
    leftovers = outlived(sampling[2] if sampling is not None else None)
    # a saved trace is judged as the live run was: the exit status, what outlived the command,
    # and the probes whose writer stopped (a trace that stops early there)
    try:
        recovered = crash_boxes.write_unreported(boxes, trace_path)
    except OSError as exc:
        recovered = []
        failures.append(f"the violations its crash boxes held could not be written: {exc.strerror or exc}")
    lost: defaultdict[int, list[str]] = defaultdict(list)
    for event in recovered:
        lost[event.pid].append(f"{event.args['count']} {event.args['kind']}")
    for pid, counts in sorted(lost.items()):
        print(
            f"kvdoctor: pid {pid} ended before writing what its ledger had counted ({', '.join(counts)}); read from its crash box into the trace",
            file=sys.stderr,
        )
    end: dict[str, Any] = {"command_exit": code}
    if leftovers:
        end["outlived"] = leftovers
    if stopped:
        end["writers_stopped"] = {str(pid): reason for pid, reason in stopped.items()}
    if paths.lost:
        end["probe_path_lost"] = list(paths.lost.values())
    try:
        finish_trace(trace_path, os.getpid(), end)
    except OSError as exc:
        failures.append(f"its end could not be written: {exc.strerror or exc}")
    if failures:  # the command's own exit status stands; what the trace lacks is said once
        print(
            f"kvdoctor: warning: the trace {trace_path} is incomplete ({'; '.join(dict.fromkeys(failures))}); "
            "what it holds is analysed (free space there, or pass --trace to another place)",
            file=sys.stderr,
        )
    return code, trace_path
