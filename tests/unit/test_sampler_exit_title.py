"""A process of the watched tree that exits is no exec: its command line reads empty (a zombie's
title falls back to its comm, "[python3]"), and the sampler keeps the title it had and does not call
`on_exec` again (which re-checked what the process was started with, now unreadable, and once
erased the PYTHONPATH a gate had found lost)."""

from __future__ import annotations

import subprocess
import sys
import time

from kvdoctor.collect.procfs import find_process_tree
from kvdoctor.collect.sampler import Sampler


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_a_process_that_exits_keeps_its_title_and_is_no_exec():
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline() == b"ready\n"  # exec'd: its own command line, not its parent's
        execs: list[int] = []
        sampler = Sampler(child.pid, with_gpu=False, tree_refresh_s=0.0, on_exec=execs.append)
        sampler.sample_once()
        title = sampler.processes[child.pid].info.title
        assert "sys.stdin.readline" in title and execs == [child.pid]
        child.stdin.close()  # it exits, and is not reaped: a zombie, its command line gone
        deadline = time.monotonic() + 30
        while _state(child.pid) != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.02)
        (info,) = [p for p in find_process_tree(child.pid) if p.pid == child.pid]
        assert info.argv_gone and info.title.startswith("[")  # what the sampler now meets
        sampler.sample_once()  # its tree scan meets the zombie; its reading then finds it exited
        tracked = sampler.processes.get(child.pid) or sampler.exited[child.pid]
        assert tracked.info.title == title and execs == [child.pid]
    finally:
        child.kill()
        child.wait()
