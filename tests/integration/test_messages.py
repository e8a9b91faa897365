"""Messages that used to mislead (#27): each is one line that says what is wrong and what to do,
exit 2, no traceback, and nothing is written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvdoctor.delivery.attach_target import PF_KTHREAD


def kv(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["run", "gate"])
@pytest.mark.parametrize("given", ["./bench.sh", "bench.sh"])
def test_a_script_that_is_not_executable_is_said_so_with_the_fix(tmp_path, command, given):
    """It used to be "command not found", for a file that is right there."""
    (tmp_path / "bench.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(tmp_path / "bench.sh", 0o644)
    line = one_line(kv(command, "--trace", str(tmp_path / "t.kvtrace.json"), "--", given, cwd=tmp_path))
    assert line.startswith(f"kvdoctor: {given} is not executable (") and "command not found" not in line
    assert "chmod +x ./bench.sh" in line and "`sh ./bench.sh`" in line
    assert not (tmp_path / "t.kvtrace.json").exists()


def _a_kernel_thread() -> int | None:
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    stat = fh.read()
                if int(stat[stat.rindex(")") + 1 :].split()[6]) & PF_KTHREAD:
                    return int(name)
            except (OSError, ValueError, IndexError):
                continue
    return None


def test_attach_to_a_kernel_thread_says_it_is_one(tmp_path):
    """It used to say "no process with pid N" of a process `ps` lists."""
    pid = _a_kernel_thread()
    if pid is None:
        pytest.skip("no kernel thread is visible in this pid namespace")
    line = one_line(kv("attach", str(pid), "--trace", str(tmp_path / "a.kvtrace.json"), cwd=tmp_path))
    assert f"pid {pid} is a kernel thread (" in line and "not a Python process" in line and "no process" not in line


def test_a_missing_baseline_is_said_as_the_baseline(tmp_path, tmp_path_factory):
    """The hint used to be about --trace, which the user did not give."""
    trace = tmp_path / "t.kvtrace.json"
    trace.write_text('[\n{"ph": "M", "name": "kvdoctor_run", "pid": 1, "args": {"schema": "kvdoctor.trace/1"}},\n')
    missing = str(tmp_path / "last-main.kvtrace.json")
    line = one_line(kv("gate", "--baseline", missing, str(trace), cwd=tmp_path))
    assert line.startswith(f"kvdoctor: --baseline {missing}: no such trace file (") and "given to --trace" not in line
    assert "drop --baseline" in line


def test_a_sample_interval_below_the_floor_is_refused(tmp_path):
    """1e-9 s was accepted and took 80% of a core; 10 ms is the floor, 0 still turns sampling off."""
    trace = tmp_path / "t.kvtrace.json"
    line = one_line(kv("run", "--sample-interval", "1e-9", "--trace", str(trace), "--", "true", cwd=tmp_path))
    assert "--sample-interval 1e-09 is below 0.01 s" in line and "0 to turn sampling off" in line
    assert not trace.exists()
    for ok in ("0.01", "0"):
        assert kv("run", "--force", "--sample-interval", ok, "--trace", str(trace), "--", "true", cwd=tmp_path).returncode == 0
