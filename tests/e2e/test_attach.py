"""`kvdoctor attach`: putting the probe into real running child processes.

The children are small Python programs that print "ready" once set up. Tests that really inject
code skip with the preflight's reason where this machine does not allow it (ptrace blocked, gdb
missing, or a gdb that cannot call functions in a process here); the refusals are tested always.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from kvdoctor.delivery import attach as attach_module
from kvdoctor.delivery.attach import attach, attach_for_watch, preflight, target_python_version
from kvdoctor.errors import KvdoctorError
from kvdoctor.trace.reader import TraceTail

BUSY = textwrap.dedent(
    """
    import time
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        x = [0] * 10          # a running server allocates all the time: that is the safe point
        time.sleep(0.01)
    """
)


@pytest.fixture
def spawn():
    children = []

    def start(source: str, env: dict | None = None) -> subprocess.Popen:
        clean = dict(os.environ if env is None else env)
        clean.pop("KVDOCTOR_TRACE", None)
        child = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True, cwd="/", env=clean)
        children.append(child)
        assert child.stdout.readline().strip() == "ready"
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()


def test_attach_to_a_pid_that_does_not_exist_says_so():
    with pytest.raises(KvdoctorError) as info:
        attach(4_000_000, "/tmp/never.kvtrace.json")
    assert info.value.one_line() == "kvdoctor: no process with pid 4000000 (check the pid with `ps`)"


def test_attach_to_a_process_that_is_not_python_says_so():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(KvdoctorError) as info:
            attach(sleeper.pid, "/tmp/never.kvtrace.json")
        line = info.value.one_line()
        assert f"pid {sleeper.pid} is not a Python process" in line and "sleep" in line and "kvdoctor run --" in line
        assert "\n" not in line
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_program_named_like_python_is_not_taken_for_one(tmp_path):
    """A copy of `sleep` called python3.11 has no interpreter to run code in: refused at once, not
    waited on for gdb's 20 s and then blamed as an idle interpreter."""
    impostor = tmp_path / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", impostor)
    sleeper = subprocess.Popen([str(impostor), "60"])
    try:
        started = time.monotonic()
        with pytest.raises(KvdoctorError) as info:
            attach(sleeper.pid, str(tmp_path / "never.kvtrace.json"))
        line = info.value.one_line()
        assert f"pid {sleeper.pid} is not a Python process" in line and "no Python C API" in line, line
        assert time.monotonic() - started < 10  # no gdb was started for it
        assert not (tmp_path / "never.kvtrace.json").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_target_python_version_is_read_from_proc(spawn):
    child = spawn(BUSY)
    assert target_python_version(child.pid) == sys.version_info[:2]


def test_a_different_python_version_is_refused_before_any_ptrace(spawn, monkeypatch):
    child = spawn(BUSY)
    monkeypatch.setattr(attach_module, "target_python_version", lambda pid: (3, 9))
    with pytest.raises(KvdoctorError) as info:
        attach(child.pid, "/tmp/never.kvtrace.json")
    assert "runs Python 3.9" in info.value.message and "kvdoctor run --" in info.value.hint


def test_a_blocked_ptrace_is_one_sentence_with_what_to_do(spawn, monkeypatch):
    child = spawn(BUSY)
    monkeypatch.setattr(attach_module, "_read", _fake_scope(3))
    with pytest.raises(KvdoctorError) as info:
        attach(child.pid, "/tmp/never.kvtrace.json")
    assert "ptrace_scope = 3" in info.value.message
    monkeypatch.setattr(attach_module, "_read", _fake_scope(2))
    monkeypatch.setattr(attach_module, "_capabilities", lambda: 0)
    assert "CAP_SYS_PTRACE" in attach_module.ptrace_blocked_reason(child.pid)


def _fake_scope(scope: int):
    real = attach_module._read

    def read(path: str) -> str:
        return f"{scope}\n" if path.endswith("ptrace_scope") else real(path)

    return read


def test_a_failed_attach_leaves_the_target_running(spawn, tmp_path):
    """Whatever gdb managed, the child must go on (no stop, no stray breakpoint, no error in it)."""
    child = spawn(BUSY)
    try:
        attach(child.pid, str(tmp_path / "t.kvtrace.json"), gdb_timeout_s=10)
    except KvdoctorError:
        pass
    time.sleep(0.5)
    assert child.poll() is None
    with open(f"/proc/{child.pid}/status") as fh:
        state = [ln for ln in fh if ln.startswith("State:")][0]
    assert "T" not in state.split()[1]


def test_watch_attach_falls_back_to_one_line(spawn, tmp_path, capsys):
    child = spawn(BUSY)
    reason = preflight()
    path = attach_for_watch(child.pid, str(tmp_path / "w.kvtrace.json"))
    err = capsys.readouterr().err.strip().splitlines()
    if reason is None:
        assert path and "probe attached" in err[-1]
    else:
        assert path is None and len(err) == 1 and "attach is not available" in err[0] and "watching from outside" in err[0]


def test_attach_puts_the_probe_into_a_running_child(spawn, tmp_path):
    reason = preflight()
    if reason:
        pytest.skip(f"attach cannot work on this machine: {reason}")
    child = spawn(BUSY)
    trace = str(tmp_path / "attached.kvtrace.json")
    status = attach(child.pid, trace)
    assert status["ok"] and not status["already_active"]
    deadline = time.monotonic() + 10
    names = []
    while time.monotonic() < deadline and "probe_status" not in names:
        time.sleep(0.2)
        if os.path.exists(trace):
            with open(trace) as fh:
                names = [json.loads(ln.rstrip().rstrip(","))["name"] for ln in fh if ln.startswith("{")]
    assert "kvdoctor_header" in names and "probe_status" in names
    assert child.poll() is None


def test_trace_tail_reads_only_complete_new_lines(tmp_path):
    path = tmp_path / "t.kvtrace.json"
    path.write_bytes(b'[\n{"ph":"i","name":"host_growth_sites","pid":7,"args":{"a":1}},\n{"ph":"i","name":"probe_st')
    tail = TraceTail(str(path))
    assert [e.pid for e in tail.poll()] == [7]
    with open(path, "ab") as fh:
        fh.write(b'atus","pid":8,"args":{}},\n')
    assert [e.name for e in tail.poll()] == ["probe_status"]
    assert tail.poll() == []


POLLER = textwrap.dedent(
    """
    import os, sys, time
    drop = sys.argv[1]
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(drop):
            path = open(drop).read()
            os.remove(drop)
            exec(compile(open(path).read(), path, "exec"), {"__name__": "__kvdoctor_attach__"})
        time.sleep(0.02)
    """
)


def test_the_injected_code_starts_the_probe_and_reports_back(tmp_path, monkeypatch):
    """Everything but the debugger: the script gdb would run is run by the child itself."""
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

        def hand_over(pid, injection, script_path, timeout_s):
            with open(drop + ".tmp", "w") as fh:
                fh.write(script_path)
            os.replace(drop + ".tmp", drop)

        monkeypatch.setattr(attach_module, "_gdb_inject", hand_over)
        monkeypatch.setattr(attach_module, "ptrace_blocked_reason", lambda pid=None: None)
        trace = str(tmp_path / "p.kvtrace.json")
        status = attach(child.pid, trace, attribution=True)
        assert status["ok"] and status["trace_path"] == trace
        deadline = time.monotonic() + 10
        components = set()
        while time.monotonic() < deadline and {"attach", "attribution"} - components:
            time.sleep(0.2)
            if os.path.exists(trace):
                with open(trace) as fh:
                    rows = [json.loads(ln.rstrip().rstrip(",")) for ln in fh if ln.startswith("{") and ln.endswith("\n")]
                components = {r["args"].get("component") for r in rows if r["name"] == "probe_status"}
        assert rows[0]["name"] == "kvdoctor_header" and rows[0]["pid"] == child.pid
        assert {"attach", "attribution"} <= components
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_attach_uses_the_gdb_the_user_names(spawn, tmp_path):
    """`--gdb PATH` (a cuda-gdb where the GPU machine has no gdb): that program is what runs, with
    gdb's arguments; a path that is no program is one line before anything is started."""
    if sys.version_info >= (3, 14):
        pytest.skip("Python 3.14 attaches with sys.remote_exec")
    child = spawn(BUSY)
    record = tmp_path / "argv.json"
    named = tmp_path / "my-gdb"
    named.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
        "print('ptrace: Operation not permitted.')\nsys.exit(1)\n"
    )
    named.chmod(0o755)
    out = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "attach", str(child.pid), "--gdb", str(named), "--trace", str(tmp_path / "t.kvtrace.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "cannot attach to pid" in out.stderr and "Traceback" not in out.stderr, out.stderr
    argv = json.loads(record.read_text())
    assert argv[argv.index("-p") + 1] == str(child.pid) and "attach.gdb" in argv, argv
    missing = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "attach", str(child.pid), "--gdb", str(tmp_path / "nothing-here")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "--gdb" in missing.stderr and "is not an executable program" in missing.stderr, missing.stderr
