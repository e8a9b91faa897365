"""Do no harm: threads calling hooks at once, bounded buffers, a server killed mid-write, and
traces that never carry prompt text or token ids."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

from conftest import sglang_env

warnings.filterwarnings("ignore")


def test_threads_share_one_probe_and_every_ledger_stays_consistent(tmp_path):
    """Four scheduler-like threads, each with its own real allocator, tree and request pool, hit the
    same probe (sites, emitter, request table, writer thread) at once; one of them leaks."""
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.demo.workload import Engine, WorkloadConfig, run_workload
    from kvdoctor.probe.core import runtime
    from kvdoctor.trace.reader import iter_events

    configs = [WorkloadConfig(fault="leak" if i == 2 else "none", page_size=1 + 3 * (i % 2), seed=i, turns=3) for i in range(4)]
    alone = [run_workload(c).outputs_digest for c in configs]
    path = str(tmp_path / "threads.json")
    probe = runtime.activate(path)
    probe.emitter.flush_interval_s = 0.01  # the writer thread races the hooks as hard as it can
    engines = [Engine(c.pool_tokens, c.page_size) for c in configs]
    results = [None] * 4
    errors = []

    def drive(i):
        try:
            results[i] = run_workload(configs[i], engines[i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(i,), name=f"scheduler-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runtime.deactivate()
    assert not errors
    assert [r.outputs_digest for r in results] == alone  # the host's results are untouched
    analysis = analyze(iter_events(path))
    assert [(f.kind, f.count) for f in analysis.errors] == [("orphan_slots", results[2].planted["orphan_slots"])]
    assert probe.failures == 0


def test_buffers_are_bounded_and_drops_are_reported(tmp_path):
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.probe.base.emitter import Emitter
    from kvdoctor.trace.reader import iter_events

    path = str(tmp_path / "drops.json")
    emitter = Emitter(path, max_buffered=100, flush_interval_s=3600, header_args={"engine": "sglang"})
    for _i in range(10_000):
        emitter.emit("violation", {"kind": "double_free", "count": 1, "site": "x"})
    assert len(emitter.buffer) == 100 and emitter.dropped == 9_900
    emitter.close()
    kinds = {f.kind: f for f in analyze(iter_events(path)).findings}
    assert kinds["events_dropped"].count == 9_900


SERVER = r"""
import sys, warnings
warnings.filterwarnings("ignore")
from kvdoctor.demo.workload import WorkloadConfig, run_workload
run_workload(WorkloadConfig(fault="leak", turns=2))
print("ready", flush=True)
while True:
    run_workload(WorkloadConfig(turns=2))
"""


def test_a_server_killed_mid_write_leaves_a_readable_trace(tmp_path):
    trace = tmp_path / "killed.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvdoctor.cli", "run", "--trace", str(trace), "--", sys.executable, "-c", SERVER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sglang_env("0.5.23"),
        cwd=tmp_path,
    )
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.5)  # the writer thread has flushed a few batches by now
    child = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid]
    assert child
    os.kill(child[0], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 137
    assert "Traceback" not in err
    replay = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "replay", str(trace), "--format", "json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert replay.returncode in (0, 1), replay.stderr
    assert '"events"' in replay.stdout and "kvdoctor_header" in trace.read_text()


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def test_traces_carry_no_token_ids(tmp_path):
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    from kvdoctor.probe.core import runtime

    path = str(tmp_path / "private.json")
    runtime.activate(path)
    for fault in ("none", "leak", "double-free"):
        run_workload(WorkloadConfig(fault=fault, token_base=9_870_000, turns=2))
    runtime.deactivate()
    text = open(path).read()
    assert "kvdoctor_header" in text and "orphan_slots" in text
    # Every token id is in 9,870,000 .. 9,870,499. Timestamps and byte counts can contain those
    # digits, so numbers are compared by value and strings by whole numbers within them.
    tokens = range(9_870_000, 9_870_500)
    leaked = []

    def walk(value):
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)) and value == int(value) and int(value) in tokens:
            leaked.append(value)
        elif isinstance(value, str):
            leaked.extend(n for n in re.findall(r"(?<!\d)\d{7}(?!\d)", value) if int(n) in tokens)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    events = [json.loads(line.rstrip().rstrip(",")) for line in text.splitlines() if line.startswith("{")]
    assert len(events) > 10
    walk(events)
    assert not leaked, leaked[:10]


FORK_CHILD = r"""
import json, os, sys
from kvdoctor.probe.core import runtime
probe = runtime.activate(sys.argv[1])
probe.status("on", "before fork")
probe.emitter.flush()
child = os.fork()
if child == 0:
    runtime.current().status("on", "in the child")
    runtime.current().emitter.flush()
    os._exit(0)
os.waitpid(child, 0)
probe.status("on", "parent after fork")
runtime.deactivate()
print(json.dumps({"parent": os.getpid(), "child": child}))
"""


def test_a_forked_child_writes_under_its_own_pid(tmp_path):
    path = tmp_path / "fork.kvtrace.json"
    proc = subprocess.run([sys.executable, "-c", FORK_CHILD, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    events = [json.loads(line.rstrip().rstrip(",")) for line in path.read_text().splitlines() if line.startswith("{")]
    said = {e["args"].get("reason"): e["pid"] for e in events if e["name"] == "probe_status"}
    assert said == {"before fork": pids["parent"], "in the child": pids["child"], "parent after fork": pids["parent"]}
    headers = sorted(e["pid"] for e in events if e["name"] == "kvdoctor_header")
    assert headers == sorted([pids["parent"], pids["child"]])
