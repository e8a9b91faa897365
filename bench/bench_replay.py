"""`replay` throughput on a large recorded trace: events per second and peak memory, streaming.

The trace is made of the events a long run really writes (ledger and memory counters, violations,
censuses, probe stats), in the proportions a probe produces them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MAKE = r"""
import sys, random
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace
path, n = sys.argv[1], int(sys.argv[2])
w = TraceWriter(path)
pid = 4242
w.write_batch([schema.header_event(pid=pid, engine="sglang", engine_version="0.5.23", process_title="sglang::scheduler")])
rng = random.Random(0)
batch = []
t = 1.7e15
for i in range(n):
    t += 1000
    r = i % 100
    if r < 60:
        e = {"ph": "C", "name": "kv_slots", "pid": pid, "tid": 1, "ts": t, "args": {"allocator": "TokenToKVPoolAllocator#0", "total_slots": 65536, "free_slots": 30000 + rng.randrange(1000), "owned_slots": 20000, "tree_slots": 15000, "tree_freed_slots": 0, "unaccounted_slots": 0}}
    elif r < 90:
        e = {"ph": "C", "name": "memory", "pid": pid, "tid": 1, "ts": t, "args": {"rss_bytes": 8 << 30, "anon_bytes": (6 << 30) + i * 1000, "shmem_bytes": 1 << 30, "pinned_bytes": 1 << 30}}
    elif r < 99:
        e = {"ph": "C", "name": "probe_stats", "pid": pid, "tid": 1, "ts": t, "args": {"hooked_calls": i, "dropped_events": 0}}
    else:
        e = {"ph": "i", "s": "p", "name": "violation", "pid": pid, "tid": 1, "ts": t, "cat": "kvdoctor.probe", "args": {"kind": "double_free", "allocator": "TokenToKVPoolAllocator#0", "count": 4, "site": "free (x.py:1)", "slot_ids": [1, 2, 3, 4], "requests": {"req 1": 4}}}
    batch.append(e)
    if len(batch) == 10000:
        w.write_batch(batch); batch = []
w.write_batch(batch)
w.close()
finish_trace(path, pid)
"""

REPLAY = r"""
import resource, sys, time, json
from kvdoctor.analysis.replay import analyze_trace
t0 = time.perf_counter()
analysis = analyze_trace(sys.argv[1])
dt = time.perf_counter() - t0
print(json.dumps({"events": analysis.events, "seconds": dt, "events_per_s": analysis.events / dt,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  # a second process reads the trace when a second core is there: its own peak
                  "peak_rss_reader_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "cpu_s": time.process_time(),
                  "findings": len(analysis.findings)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=2_000_000)
    parser.add_argument("--out")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "big.kvtrace.json")
    subprocess.run([sys.executable, "-c", MAKE, path, str(args.events)], check=True)
    size = os.path.getsize(path)
    baseline = subprocess.run(
        [
            sys.executable,
            "-c",
            "import resource; import kvdoctor.analysis.replay; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    out = subprocess.run([sys.executable, "-c", REPLAY, path], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    report["trace_bytes"] = size
    report["import_rss_bytes"] = int(baseline.stdout.strip())
    report["target_events_per_s"] = 1_000_000
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    os.remove(path)


if __name__ == "__main__":
    main()
