"""What `run` found a Python process lost of the probe's way in is kept when that process exits:
its exit changes the title the sampler sees (a zombie's title is its comm), which re-runs the
check, and a zombie's exe and environment can no longer be read. The CI gate over a short
benchmark lost its cause that way: it said only "did the server start, and under kvdoctor?"."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvdoctor.collect.procfs import read_title
from kvdoctor.delivery.launch import INJECT_DIR, ProbePathCheck, probe_path_lost


def _child(pythonpath: str) -> subprocess.Popen:
    env = {"PATH": os.environ.get("PATH", ""), "KVDOCTOR_TRACE": "/nonexistent.kvtrace.json", "PYTHONPATH": pythonpath}
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert child.stdout.readline() == b"ready\n"  # exec'd and running: its own exe and environment, not the parent's
    return child


def _until_zombie(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not exit")


def test_a_lost_pythonpath_is_kept_once_the_process_is_a_zombie(tmp_path):
    child = _child(str(tmp_path))
    try:
        check = ProbePathCheck()
        check(child.pid)
        assert check.lost[child.pid]["lost"] == "PYTHONPATH", check.lost
        child.stdin.close()
        _until_zombie(child.pid)  # not reaped: what the sampler meets between exit and wait
        assert read_title(child.pid).startswith("["), read_title(child.pid)  # the title changed: the check runs again
        assert probe_path_lost(child.pid) is None
        check(child.pid)
        assert check.lost[child.pid]["lost"] == "PYTHONPATH", check.lost
    finally:
        child.kill()
        child.wait()


def test_a_process_that_kept_the_path_is_recorded_as_nothing_lost(tmp_path):
    child = _child(f"{tmp_path}{os.pathsep}{INJECT_DIR}")
    try:
        check = ProbePathCheck()
        assert probe_path_lost(child.pid) == ""
        check(child.pid)
        assert check.lost == {}
    finally:
        child.kill()
        child.wait()
