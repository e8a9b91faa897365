"""`kvdoctor attach` and the paths it is given or makes: the trace it claims before anything is
injected, a probe that never blocks its server on a FIFO, and a temp dir whose name holds quotes.

Real child processes that print "ready". The tests that really inject skip with the preflight's
reason where this machine cannot (ptrace blocked, gdb missing or unable to call functions); the
code gdb hands to the target is also run by the child itself, so that path is tested everywhere.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, trace_events

from kvdoctor.delivery import attach as attach_module
from kvdoctor.delivery.attach import attach, preflight, ptrace_blocked_reason
from kvdoctor.delivery.attach_code import gdb_script_for, run_script_code
from kvdoctor.trace import schema

BUSY = textwrap.dedent(
    """
    import time
    print("ready", flush=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        x = [0] * 10          # a running server allocates all the time: that is the safe point
        time.sleep(0.01)
    """
)
# A temp dir name with everything that could end a string literal or change code around it.
NASTY = 'it\'s "quoted" \\ {braces} $x #y \u00e9\nline'
MINE = "my notes\n"


def device_node(directory) -> str:
    """A character device: a null device of the test's own where it may make one, else /dev/null."""
    path = os.path.join(directory, "null-device")
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        return path
    except PermissionError:
        return "/dev/null"


def kv(*args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout, env=env)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvdoctor: "), (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture
def spawn(tmp_path):
    children = []

    def start(source: str = BUSY) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "KVDOCTOR_TRACE"}
        stderr = open(tmp_path / f"child-{len(children)}.stderr", "w+")
        child = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=stderr, text=True, cwd="/", env=env)
        child.stderr_file = stderr  # type: ignore[attr-defined]
        children.append(child)
        assert child.stdout.readline().strip() == "ready"
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()
        child.stderr_file.close()


def child_stderr(child) -> str:
    child.stderr_file.seek(0)
    return child.stderr_file.read()


def _need_ptrace(pid: int) -> None:
    reason = ptrace_blocked_reason(pid)
    if reason:
        pytest.skip(f"ptrace is not allowed here: {reason}")


def _need_attach() -> None:
    reason = preflight()
    if reason:
        pytest.skip(f"attach cannot work on this machine: {reason}")


# ---------------------------------------------------------------- the trace attach claims


def test_attach_refuses_a_trace_path_it_did_not_create_before_injecting(spawn, tmp_path):
    child = spawn()
    _need_ptrace(child.pid)
    mine = tmp_path / "notes.kvtrace.json"
    mine.write_text(MINE)
    bracket = tmp_path / "list.json"
    bracket.write_text("[1, 2]")
    target = tmp_path / "target.txt"
    target.write_text(MINE)
    link = tmp_path / "link.kvtrace.json"
    link.symlink_to(target)
    fifo = tmp_path / "pipe.kvtrace.json"
    os.mkfifo(fifo)
    device = device_node(tmp_path)
    cases = {
        str(mine): "exists: kvdoctor will not replace it",
        str(bracket): "exists: kvdoctor will not replace it",
        str(link): "is a symbolic link: kvdoctor will not write through it",
        device: "is not a regular file",
        str(fifo): "is not a regular file",
    }
    for path, said in cases.items():
        assert said in one_line_error(kv("attach", str(child.pid), "--trace", path)), path
    assert one_line_error(kv("attach", str(child.pid), "--trace", str(fifo), "--force"))
    assert one_line_error(kv("attach", str(child.pid), "--trace", device, "--force"))
    assert mine.read_text() == MINE and bracket.read_text() == "[1, 2]" and target.read_text() == MINE and os.path.islink(link)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat(device).st_mode)
    assert child.poll() is None and "kvdoctor" not in child_stderr(child)


def test_attach_with_force_replaces_a_file_and_the_trace_is_private(spawn, tmp_path):
    child = spawn()
    _need_attach()
    mine = tmp_path / "old.kvtrace.json"
    mine.write_text(MINE)
    proc = kv("attach", str(child.pid), "--trace", str(mine), "--force")
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(os.lstat(mine).st_mode) == 0o600
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not trace_events(str(mine), schema.HEADER):
        time.sleep(0.2)
    [header] = trace_events(str(mine), schema.HEADER)
    assert header["pid"] == child.pid and MINE not in mine.read_text()
    assert child.poll() is None


# ---------------------------------------------------------------- a probe never blocks on its trace

PROBED = textwrap.dedent(
    """
    import sys
    from kvdoctor.probe.core import runtime
    probe = runtime.activate(sys.argv[1])
    probe.emitter.emit("probe_status", {"component": "test", "state": "on", "reason": "x"})
    probe.emitter.flush()
    print("flushed", flush=True)
    """
)


def test_a_probe_given_a_fifo_or_a_link_writes_nothing_there_and_its_process_still_exits(tmp_path):
    """What a trace swapped for a FIFO or a link after attach claimed it meets: the writer thread
    must not block opening it (it held the emitter's lock, and the exit waited on it forever)."""
    fifo = tmp_path / "pipe.kvtrace.json"
    os.mkfifo(fifo)
    target = tmp_path / "target.txt"
    target.write_text(MINE)
    link = tmp_path / "link.kvtrace.json"
    link.symlink_to(target)
    for path in (fifo, link, device_node(tmp_path)):
        env = {k: v for k, v in os.environ.items() if k != "KVDOCTOR_TRACE"}
        env["PYTHONPATH"] = REPO
        proc = subprocess.run([sys.executable, "-c", PROBED, str(path)], capture_output=True, text=True, timeout=60, env=env, cwd="/")
        assert proc.returncode == 0 and proc.stdout == "flushed\n" and "Traceback" not in proc.stderr, (path, proc.stderr)
    assert target.read_text() == MINE and os.path.islink(link) and stat.S_ISFIFO(os.stat(fifo).st_mode)


# ---------------------------------------------------------------- a temp dir with quotes in its name


def test_the_code_gdb_hands_over_runs_the_script_whatever_the_temp_dir_is_called(tmp_path):
    workdir = tmp_path / NASTY
    workdir.mkdir()
    marker = tmp_path / "ran"
    script = workdir / "inject.py"
    script.write_text(f"open({str(marker)!r}, 'w').write(__name__)\n")
    code = run_script_code(str(script))
    assert code.isascii() and code.isprintable()
    exec(compile(code, "<gdb>", "exec"), {})
    assert marker.read_text() == "__kvdoctor_attach__"
    # gdb reads the code as a C string literal: undo its escapes, get the same code back
    literal = re.search(r'PyRun_SimpleString\("((?:[^"\\]|\\.)*)"\)', gdb_script_for(str(script), "gdb-armed")).group(1)
    assert re.sub(r"\\(.)", r"\1", literal) == code


POLLER = textwrap.dedent(
    """
    import os, sys, time
    drop = sys.argv[1]
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(drop):
            code = open(drop).read()
            os.remove(drop)
            exec(code, {})            # what PyRun_SimpleString runs in the target
        time.sleep(0.02)
    """
)


def test_attach_from_a_temp_dir_with_quotes_runs_the_probe_in_the_target(tmp_path, monkeypatch):
    """Everything but the debugger: the code gdb would hand over is run by the child itself."""
    temp = tmp_path / NASTY
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr("tempfile.tempdir", None)
    drop = str(tmp_path / "drop")
    stderr = tmp_path / "child.stderr"
    with open(stderr, "w") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", POLLER, drop],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd="/",
            env={k: v for k, v in os.environ.items() if k != "KVDOCTOR_TRACE"},
        )
    try:
        assert child.stdout.readline().strip() == "ready"

        def hand_over(pid, injection, script_path, timeout_s):
            assert script_path.startswith(str(temp))
            with open(drop + ".tmp", "w") as fh:
                fh.write(run_script_code(script_path))
            os.replace(drop + ".tmp", drop)

        monkeypatch.setattr(attach_module, "_gdb_inject", hand_over)
        monkeypatch.setattr(attach_module, "ptrace_blocked_reason", lambda pid=None: None)
        trace = str(tmp_path / "p.kvtrace.json")
        status = attach(child.pid, trace)
        assert status["ok"] and status["trace_path"] == trace
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
    assert "Traceback" not in stderr.read_text() and os.listdir(temp) == []  # and nothing left in the temp dir


def test_kvdoctor_attach_with_quotes_in_tmpdir_leaves_no_traceback_in_the_server(spawn, tmp_path):
    child = spawn()
    _need_attach()
    temp = tmp_path / NASTY
    temp.mkdir()
    trace = tmp_path / "t.kvtrace.json"
    proc = kv("attach", str(child.pid), "--trace", str(trace), env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr
    assert "probe attached" in proc.stderr
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not trace_events(str(trace), schema.HEADER):
        time.sleep(0.2)
    assert trace_events(str(trace), schema.HEADER)
    assert "Traceback" not in child_stderr(child) and "SyntaxError" not in child_stderr(child)
    assert child.poll() is None and os.listdir(temp) == []
