"""`kvdoctor run` against what its command and its readers do to it (issue 52): a stderr reader
that goes away, a rendezvous file the command names itself. `run` is started for real."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

from conftest import REPO

from kvdoctor.trace import schema


def kv_run(tmp_path, *command: str, stderr=subprocess.PIPE, timeout: float = 120) -> subprocess.CompletedProcess:
    """`kvdoctor run` of `command`; the result's `pid` is run's own (its rendezvous directory's name)."""
    trace = str(tmp_path / "t.kvtrace.json")
    args = [sys.executable, "-m", "kvdoctor.cli", "run", "--sample-interval", "0", "--trace", trace, "--", *command]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO) as run:
        out, err = run.communicate(timeout=timeout)
    proc = subprocess.CompletedProcess(args, run.returncode, out, err)
    proc.pid = run.pid  # type: ignore[attr-defined]
    return proc


def _run_dirs(pid: int | str = "*") -> set[str]:
    """The rendezvous directories in the temp dir, of one run (by its pid) or of all."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"kvdoctor-run-{pid}-*")))


# ---------------------------------------------------------------- item 10: a stderr reader that goes away


def test_a_stderr_reader_that_went_away_leaves_runs_exit_code(tmp_path):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before run writes its first line: every write meets EPIPE
    try:
        proc = kv_run(tmp_path, "sh", "-c", "exit 7", stderr=write)
    finally:
        os.close(write)
    assert proc.returncode == 7  # before: 1 (the summary's EPIPE became an internal error)


# ---------------------------------------------------------------- item 11: rendezvous names the command chose


def test_rendezvous_files_with_non_ascii_digits_do_not_crash_run(tmp_path):
    script = 'touch "$KVDOCTOR_RENDEZVOUS/writer-stopped.²" "$KVDOCTOR_RENDEZVOUS/ledger.²" "$KVDOCTOR_RENDEZVOUS/writer-stopped.٣"; exit 3'
    proc = kv_run(tmp_path, "sh", "-c", script)
    assert proc.returncode == 3, proc.stderr[-2000:]  # before: 2, internal error: ValueError
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    with open(tmp_path / "t.kvtrace.json") as fh:
        trace = json.load(fh)
    ends = [e for e in trace if e.get("name") == schema.TRACE_END]
    assert len(ends) == 1 and ends[0]["args"]["command_exit"] == 3
    assert _run_dirs(proc.pid) == set()  # the rendezvous directory is gone


# ---------------------------------------------------------------- item 16: what a killed or interrupted run leaves


def _pid_never_running() -> int:
    with open("/proc/sys/kernel/pid_max") as fh:
        return int(fh.read()) + 1  # above pid_max: no process has it


def test_the_next_run_removes_what_sigkilled_runs_left_in_tmp(tmp_path):
    import shutil

    tmp, token = tempfile.gettempdir(), os.path.basename(str(tmp_path))
    dead = os.path.join(tmp, f"kvdoctor-run-{_pid_never_running()}-{token}")
    alive = os.path.join(tmp, f"kvdoctor-run-{os.getpid()}-{token}")
    link = os.path.join(tmp, f"kvdoctor-run-{_pid_never_running()}-{token}link")
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "keep").write_text("kept")
    try:
        os.mkdir(dead)
        os.mkdir(alive)
        os.symlink(other, link)
        open(os.path.join(dead, "census.request"), "w").close()
        proc = kv_run(tmp_path, "true")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not os.path.exists(dead)  # before: every SIGKILLed run left one
        assert os.path.isdir(alive) and os.path.islink(link) and (other / "keep").read_text() == "kept"
    finally:
        shutil.rmtree(dead, ignore_errors=True)
        shutil.rmtree(alive, ignore_errors=True)
        if os.path.islink(link):
            os.unlink(link)


def test_a_sigkilled_runs_directory_is_named_by_its_pid(tmp_path):
    import signal
    import time

    trace = str(tmp_path / "t.kvtrace.json")
    run = subprocess.Popen(
        [sys.executable, "-m", "kvdoctor.cli", "run", "--sample-interval", "0", "--trace", trace, "--", "sleep", "60"],
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not _run_dirs(run.pid) and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.05)
    left = _run_dirs(run.pid)
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    assert len(left) == 1 and all(os.path.isdir(p) for p in left)  # before: kvdoctor-run-XXXXXXXX, no pid to tell it by
    (tmp_path / "next").mkdir()  # the command (sleep) dies with its run (PR_SET_PDEATHSIG)
    assert kv_run(tmp_path / "next", "true").returncode == 0
    assert not any(os.path.exists(p) for p in left)


def test_ctrl_c_while_the_command_line_imports_is_one_line(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "typer.py").write_text("raise KeyboardInterrupt  # Ctrl-C while the command line's modules import\n")
    env = {**os.environ, "PYTHONPATH": str(fake)}
    proc = subprocess.run([sys.executable, "-m", "kvdoctor", "--help"], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr == "kvdoctor: interrupted\n"  # before: a traceback


def test_the_next_run_removes_the_crash_boxes_sigkilled_runs_left_in_dev_shm(tmp_path):
    """A GPU ledger's crash box is memory (/dev/shm), 8 bytes a page: a run SIGKILLed with its
    command left it there until the machine restarts. The next run removes those of runs that are
    gone, and no other file."""
    if not os.path.isdir("/dev/shm"):
        import pytest

        pytest.skip("no /dev/shm here")
    token = os.path.basename(str(tmp_path)).replace("-", "_")
    dead = f"/dev/shm/kvdoctor-box-kvdoctor-run-{_pid_never_running()}-{token}-4242-7f00aa"
    alive = f"/dev/shm/kvdoctor-box-kvdoctor-run-{os.getpid()}-{token}-4242-7f00aa"
    unlike = f"/dev/shm/kvdoctor-box-{token}-not-a-run"
    try:
        for path in (dead, alive, unlike):
            with open(path, "wb") as fh:
                fh.write(b"\0" * 4096)
        assert kv_run(tmp_path, "true").returncode == 0
        assert not os.path.exists(dead)  # before: kept until the machine restarted
        assert os.path.exists(alive) and os.path.exists(unlike)
    finally:
        for path in (dead, alive, unlike):
            if os.path.exists(path):
                os.unlink(path)
