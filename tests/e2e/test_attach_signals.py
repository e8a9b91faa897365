"""An attach that is interrupted leaves a healthy target: no breakpoint left in it, no probe put in
after the user cancelled, no file left in the temp dir (#27, item 1).

The target is a small Python program that reports where `PyObject_Malloc`'s first bytes are, then
blocks reading stdin: it runs no Python code, so gdb's breakpoints stay in it, waiting. The test
reads the target's memory to see them go in (the moment that matters), signals `kvdoctor attach`
the way `timeout`, Ctrl-C, a closed terminal or the OOM killer would, waits until nothing traces
the target, and then wakes it: it must allocate (run over the breakpoints' places), say that no
kvdoctor module came into it, and exit 0 by itself. These tests need gdb to attach and set
breakpoints, not to call functions, so they run where the full attach preflight fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvdoctor.delivery import attach as attach_module
from kvdoctor.delivery.attach import attach, ptrace_blocked_reason
from kvdoctor.delivery.attach_inject import AttachCancelled

TARGET = textwrap.dedent(
    """
    import ctypes, sys
    address = ctypes.cast(ctypes.pythonapi.PyObject_Malloc, ctypes.c_void_p).value
    print(address, ctypes.string_at(address, 64).hex(), flush=True)
    sys.stdin.readline()                      # idle, in a system call: no safe point until woken
    x = [[0] * 10 for _ in range(1000)]       # then allocate: a breakpoint left behind is a SIGTRAP here
    print("modules", any(name.startswith("kvdoctor") for name in sys.modules), flush=True)
    """
)


def _needs_gdb() -> None:
    if sys.version_info >= (3, 14):
        pytest.skip("these cases are about gdb; Python 3.14 attaches with sys.remote_exec")
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed")
    reason = ptrace_blocked_reason(None)
    if reason:
        pytest.skip(f"ptrace is not allowed here: {reason}")


def _tracer(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("TracerPid:")).split()[1])


def _code_changed(pid: int, address: int, original: bytes) -> bool:
    with open(f"/proc/{pid}/mem", "rb") as fh:
        fh.seek(address)
        return fh.read(len(original)) != original


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(0.02)


@pytest.fixture
def target():
    _needs_gdb()
    child = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    address, code = child.stdout.readline().split()
    yield child, int(address), bytes.fromhex(code)
    if child.poll() is None:
        child.kill()
        child.wait()


AS_A_TERMINALS_JOB = (
    "import os, signal, sys\n"
    "for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):\n"
    "    signal.signal(sig, signal.SIG_DFL)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)


def _start_attach(pid: int, tmp_path) -> tuple[subprocess.Popen, str, str]:
    """`kvdoctor attach PID` in a process group of its own (as `timeout` runs its command), with a
    temp dir of its own so what it leaves there is seen."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    trace = str(tmp_path / "attached.kvtrace.json")
    # gdb's wait for a safe point long past the test's own wait for its breakpoints (60 s): on a loaded
    # machine gdb took 20 s to put them in, the default wait was over, and the signal came too late
    env = {**os.environ, "TMPDIR": str(temp), "KVDOCTOR_ATTACH_WAIT_S": "300"}
    # A terminal's job takes SIGHUP, SIGINT and SIGTERM: under `nohup` (or `cmd &` from a script) the
    # tests would inherit them ignored, and kvdoctor keeps an ignored signal ignored, as it should.
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_A_TERMINALS_JOB, "-m", "kvdoctor.cli", "attach", str(pid), "--trace", trace],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    return proc, str(temp), trace


SENDS = {
    "timeout -s TERM (the whole group)": (signal.SIGTERM, True),
    "timeout -s KILL (the whole group)": (signal.SIGKILL, True),
    "Ctrl-C (the whole group)": (signal.SIGINT, True),
    "a closed terminal (the whole group)": (signal.SIGHUP, True),
    "kill -TERM of kvdoctor alone": (signal.SIGTERM, False),
    "kill -KILL of kvdoctor alone": (signal.SIGKILL, False),
}


def _send(proc: subprocess.Popen, signum: int, group: bool) -> None:
    if group:
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)


def _after_the_cancel(proc, child, temp: str, trace: str, signum: int) -> None:
    """Whatever kvdoctor said, once nothing traces the target: woken, it runs, has no probe, exits 0."""
    _, err = proc.communicate(timeout=180)
    if signum != signal.SIGKILL:
        assert proc.returncode == 128 + signum, err
        assert f"attach cancelled by {signal.Signals(signum).name}: nothing was put into pid {child.pid}" in err, err
        assert "Traceback" not in err, err
    _wait_for(lambda: _tracer(child.pid) == 0 and not os.listdir(temp), "gdb to leave the target and the attach's files to go")
    out, _ = child.communicate("wake\n", timeout=60)
    assert child.returncode == 0, f"the target died of signal {-child.returncode}"
    assert out.strip() == "modules False"
    assert not os.path.exists(trace)


@pytest.mark.parametrize("how", list(SENDS))
def test_a_signal_while_gdb_waits_at_its_breakpoints_leaves_the_target_healthy(target, tmp_path, how):
    signum, group = SENDS[how]
    child, address, original = target
    proc, temp, trace = _start_attach(child.pid, tmp_path)
    _wait_for(lambda: _code_changed(child.pid, address, original), "gdb's breakpoint in PyObject_Malloc")
    _send(proc, signum, group)
    _after_the_cancel(proc, child, temp, trace, signum)


EARLY = {
    "the attach's directory exists": lambda child, temp: bool(os.listdir(temp)),
    "gdb traces the target (its breakpoints not yet in)": lambda child, temp: _tracer(child.pid) != 0,
}


@pytest.mark.parametrize("moment", list(EARLY))
@pytest.mark.parametrize("how", ["timeout -s TERM (the whole group)", "kill -KILL of kvdoctor alone"])
def test_a_signal_before_the_breakpoints_are_in_leaves_the_target_healthy(target, tmp_path, how, moment):
    """Earlier moments: gdb not started yet, or attached and reading symbols (a SIGINT then ends
    only that step, and gdb would go on to set its breakpoints: the guard repeats it)."""
    signum, group = SENDS[how]
    child, _, _ = target
    proc, temp, trace = _start_attach(child.pid, tmp_path)
    _wait_for(lambda: EARLY[moment](child, temp), moment)
    _send(proc, signum, group)
    _after_the_cancel(proc, child, temp, trace, signum)


POLLER = textwrap.dedent(
    """
    import os, sys, time
    drop = sys.argv[1]
    print("ready", flush=True)
    while not os.path.exists(drop):
        time.sleep(0.02)
    source = open(drop).read()
    exec(compile(source, "inject.py", "exec"), {"__name__": "__kvdoctor_attach__"})
    time.sleep(1)  # the probe's thread would start here
    print("modules", any(name.startswith("kvdoctor") for name in sys.modules), flush=True)
    """
)


def test_code_that_arrives_after_a_cancel_does_nothing(tmp_path, monkeypatch):
    """The injected code runs only if the attach was not cancelled before it got there: a debugger
    (or sys.remote_exec) that runs it late, after the user's SIGTERM, changes nothing in the target."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the test signals its own process: its handler is installed only from the main thread")
    drop = str(tmp_path / "drop")
    child = subprocess.Popen(
        [sys.executable, "-c", POLLER, drop],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        env={k: v for k, v in os.environ.items() if k != "KVDOCTOR_TRACE"},
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        late: list[str] = []

        def cancelled_while_injecting(pid, injection, script_path, timeout_s):
            with open(script_path) as fh:
                late.append(fh.read())  # what a late debugger would run
            os.kill(os.getpid(), signal.SIGTERM)  # the user's cancel, recorded by the attach
            time.sleep(0.5)

        monkeypatch.setattr(attach_module, "_gdb_inject", cancelled_while_injecting)
        monkeypatch.setattr(attach_module, "ptrace_blocked_reason", lambda pid=None: None)
        trace = str(tmp_path / "late.kvtrace.json")
        with pytest.raises(AttachCancelled) as info:
            attach(child.pid, trace)
        assert info.value.exit_code == 128 + signal.SIGTERM and "nothing was put into" in info.value.message
        with open(drop + ".tmp", "w") as fh:
            fh.write(late[0])
        os.replace(drop + ".tmp", drop)
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0 and out.strip() == "modules False"
        assert not os.path.exists(trace)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# A target that ends while gdb waits at its breakpoints: stdin's end gives `os.read` the empty-bytes
# singleton (no allocation), so the next allocation it makes is its interpreter's own, shutting down.
EXITING = textwrap.dedent(
    """
    import ctypes, os
    address = ctypes.cast(ctypes.pythonapi.PyObject_Malloc, ctypes.c_void_p).value
    print(address, ctypes.string_at(address, 64).hex(), flush=True)
    os.read(0, 1)
    """
)


def test_a_target_that_exits_while_gdb_waits_is_left_to_exit_cleanly(tmp_path):
    """The first safe point such a target reaches is inside its own shutdown, where Python code
    cannot run: calling into it there crashed it (SIGSEGV at exit) and left `attach` waiting two
    minutes. Now nothing is run in it, it exits 0, and `attach` says why it did not attach. Unlike
    the cases above it needs the whole attach: a gdb that cannot call functions here is refused
    before the target's exit is seen, so it skips where the attach preflight fails."""
    _needs_gdb()
    reason = attach_module.preflight()
    if reason:
        pytest.skip(f"attach cannot work on this machine: {reason}")
    child = subprocess.Popen([sys.executable, "-c", EXITING], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        address, code = child.stdout.readline().split()
        proc, temp, trace = _start_attach(child.pid, tmp_path)
        _wait_for(lambda: _code_changed(child.pid, int(address), bytes.fromhex(code)), "gdb's breakpoint in PyObject_Malloc")
        child.stdin.close()  # the target's read ends: it exits, through its interpreter's shutdown
        assert child.wait(timeout=120) == 0, f"the target died of signal {-child.returncode}"
        _, err = proc.communicate(timeout=180)
        assert proc.returncode != 0 and f"cannot attach to pid {child.pid}: it is exiting" in err, err
        assert "Traceback" not in err, err
        assert not os.path.exists(trace)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
