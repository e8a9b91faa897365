"""A process that outlives `run`/`gate` is said, not passed over (#27 item 15).

The command starts two real processes that leave its process group (one with `setsid`, one in a
group of its own), so `run` does not end them. It waits until the sampler has recorded both in
the trace (it reads its own trace: no sleep that a loaded machine could outrun), runs a small
probed workload and exits 0. `run` must name both at its end on stderr, the trace must carry them,
and the gate must say so in a warning line that does not fail it (a saved trace of `run` is judged
as the live gate judges it: tests/integration/test_saved_trace_verdict.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

COMMAND = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    sleeper = "import time; time.sleep(600)"
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # as a daemon detaches
    daemon = subprocess.Popen(["leftover-daemon", "-c", sleeper], executable=sys.executable, start_new_session=True, **quiet)
    grouped = subprocess.Popen(["leftover-grouped", "-c", sleeper], executable=sys.executable, process_group=0, **quiet)
    with open(os.environ["KVDOCTOR_LEFTOVERS"], "w") as fh:
        json.dump([daemon.pid, grouped.pid], fh)
    seen, deadline = set(), time.monotonic() + 120
    while seen != {daemon.pid, grouped.pid} and time.monotonic() < deadline:
        with open(os.environ["KVDOCTOR_TRACE"]) as fh:
            for line in fh:
                if line.startswith("{") and line.endswith("\\n"):
                    event = json.loads(line.rstrip().rstrip(","))
                    if event["name"] == "memory":
                        seen.add(event["pid"])
        seen &= {daemon.pid, grouped.pid}
        time.sleep(0.1)
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    run_workload(WorkloadConfig(fault="none", turns=2))
    """
)


def _kv(*args: str, cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def _leftovers(path: str) -> list[int]:
    with open(path) as fh:
        return json.load(fh)


def _end_them(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_processes_that_leave_the_group_are_named_by_run_the_trace_and_the_gate(tmp_path):
    record = str(tmp_path / "leftovers.json")
    env = {**os.environ, "KVDOCTOR_LEFTOVERS": record}
    trace = str(tmp_path / "run.kvtrace.json")
    pids: list[int] = []
    try:
        ran = _kv("run", "--trace", trace, "--", sys.executable, "-c", COMMAND, cwd=tmp_path, env=env)
        pids = _leftovers(record)
        assert ran.returncode == 0, ran.stderr[-3000:]
        for pid in pids:
            os.kill(pid, 0)  # both still run: `run` left them alone
        said = [line for line in ran.stderr.splitlines() if "outlived" in line]
        assert len(said) == 1, ran.stderr[-3000:]
        assert said[0].startswith("kvdoctor: 2 process(es) started by the command outlived it: ")
        assert f"pid {pids[0]} (" in said[0] and "leftover-daemon" in said[0]
        assert f"pid {pids[1]} (" in said[0] and "leftover-grouped" in said[0]
        with open(trace) as fh:
            end = json.loads([line for line in fh if '"kvdoctor_end"' in line][-1].rstrip().rstrip(","))
        assert [p["pid"] for p in end["args"]["outlived"]] == sorted(pids)

        later = _kv("gate", "--max-growth", "off", trace, cwd=tmp_path, env=env)  # a run of seconds: growth is not its case
        assert later.returncode == 0, later.stdout
        warn = [line for line in later.stdout.splitlines() if line.startswith("  WARN  no-leftover-processes: ")]
        assert len(warn) == 1 and f"pid {pids[0]}" in warn[0] and f"pid {pids[1]}" in warn[0], later.stdout
        assert "kvdoctor gate: PASS (" in later.stdout and ", 1 warning, 1 turned off: max-growth)" in later.stdout
    finally:
        if os.path.exists(record):
            _end_them(_leftovers(record))


def test_a_command_whose_children_all_end_has_no_warning(tmp_path):
    """The control: a child in the command's own group is ended with it, and nothing is said."""
    command = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(3)"
    trace = str(tmp_path / "r.kvtrace.json")
    ran = _kv("run", "--trace", trace, "--", sys.executable, "-c", command, cwd=tmp_path, env=dict(os.environ))
    assert ran.returncode == 0 and "outlived" not in ran.stderr, ran.stderr[-2000:]
    later = _kv("gate", trace, cwd=tmp_path, env=dict(os.environ))
    assert "  PASS  no-leftover-processes: no process the sampler saw outlived the command" in later.stdout, later.stdout
