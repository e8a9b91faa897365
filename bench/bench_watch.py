"""What `kvdoctor watch` costs and how fast and how falsely it flags growth.

* watcher CPU: the sampling loop of `watch` (sampler, trace writer, growth detector) at 10 Hz on
  a 4-process tree of sleeping Python processes, as a percentage of one core;
* time to flag a synthetic 10 GB/h leak after warm-up, at 1 Hz and 10 Hz (fake clock);
* false alarms over 20 synthetic noisy plateaus (checked every 30 s, as a long watch would be).

Prints one JSON object; `--out PATH` writes it there too.
Usage: python bench/bench_watch.py [--seconds 20] [--out bench-watch.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvdoctor.analysis import growth
from kvdoctor.analysis.detectors.memory_growth import MemoryGrowthDetector
from kvdoctor.collect.sampler import Sampler
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter

MIB = 1024 * 1024
GB = 1e9

TREE = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(3)]
time.sleep(0.5)
print("ready", flush=True)
time.sleep(600)
"""


def watcher_cpu(seconds: float, hz: float) -> dict:
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "ready"
        with tempfile.TemporaryDirectory() as tmp:
            writer = TraceWriter(os.path.join(tmp, "bench.kvtrace.json"))
            # no warm-up, so the final analysis has every sample to work on, as a long watch would
            detector = MemoryGrowthDetector(growth.GrowthParams(warmup_s=0.0, min_span_s=10.0))
            sampler = Sampler(root.pid, interval_s=1.0 / hz)

            def on_round(events: list[schema.Event]) -> None:
                writer.write_batch(events)
                for event in events:
                    detector.feed(event)

            cpu0, wall0 = time.process_time(), time.monotonic()
            sampler.run(seconds, on_round=on_round)
            cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - wall0
            writer.close()
            trace_bytes = os.path.getsize(os.path.join(tmp, "bench.kvtrace.json"))
            t0 = time.perf_counter()
            detector.findings()
            analysis_s = time.perf_counter() - t0
        processes = len(sampler.processes)
        with open(f"/proc/{root.pid}/maps") as fh:
            mappings = sum(1 for _ in fh)
    finally:
        for pid in _descendants(root.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        root.kill()
        root.wait()
    return {
        "hz": hz,
        "processes": processes,
        "mappings_per_process": mappings,
        "rounds": sampler.rounds,
        "wall_s": round(wall_s, 2),
        "cpu_s": round(cpu_s, 3),
        "cpu_percent_of_one_core": round(100.0 * cpu_s / wall_s, 2),
        "cpu_ms_per_round": round(1000.0 * cpu_s / max(sampler.rounds, 1), 3),
        "trace_bytes_per_s": round(trace_bytes / wall_s),
        "final_analysis_s": round(analysis_s, 3),
    }


def _descendants(pid: int) -> list[int]:
    from kvdoctor.collect.procfs import find_process_tree

    return [p.pid for p in find_process_tree(pid) if p.pid != pid]


def time_to_flag(hz: float, *, warmup_s: float = 60.0, horizon_s: float = 300.0, noise_mib: float = 20.0, seed: int = 0) -> float | None:
    """Seconds of post-warm-up data until a 10 GB/h leak is first flagged, checking every second."""
    rng = random.Random(seed)
    rate = 10 * GB / 3600
    n = int((warmup_s + horizon_s) * hz)
    times = [k / hz for k in range(n)]
    values = [4 * GB + 2 * GB * (1 - math.exp(-t / 10)) + rate * t + rng.gauss(0, noise_mib * MIB) for t in times]
    for s in range(1, int(horizon_s) + 1):
        m = int((warmup_s + s) * hz)
        if growth.detect_growth(times[:m], values[:m], warmup_s=warmup_s):
            return float(s)
    return None


def false_alarms(runs: int = 20, *, duration_s: int = 900, noise_mib: float = 30.0) -> dict:
    """Noisy plateaus after a warm-up ramp: how many runs get flagged at any 30 s check, and at the end."""
    any_check = 0
    at_end = 0
    checks = 0
    for seed in range(runs):
        rng = random.Random(1000 + seed)
        times = [float(k) for k in range(duration_s)]
        values = [3 * GB + 1 * GB * (1 - math.exp(-t / 20)) + rng.gauss(0, noise_mib * MIB) for t in times]
        flagged = False
        for end in range(120, duration_s + 1, 30):
            checks += 1
            if growth.detect_growth(times[:end], values[:end]):
                flagged = True
        any_check += flagged
        at_end += growth.detect_growth(times, values) is not None
    return {"runs": runs, "checks": checks, "runs_flagged_at_any_check": any_check, "runs_flagged_at_end": at_end}


def detect_cost_ms(points: int = 20_000) -> float:
    rng = random.Random(5)
    times = [k * 0.1 for k in range(points)]
    values = [3 * GB + rng.gauss(0, 10 * MIB) for _ in times]
    t0 = time.perf_counter()
    for _ in range(5):
        growth.detect_growth(times, values, warmup_s=0)
    return round((time.perf_counter() - t0) / 5 * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to run the 10 Hz sampler")
    parser.add_argument("--out", help="also write the JSON result here")
    args = parser.parse_args()
    result = {
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "numpy": growth._np is not None},
        "watcher_cpu_10hz_4proc": watcher_cpu(args.seconds, 10.0),
        "time_to_flag_10gb_per_h_s": {"1hz": time_to_flag(1.0), "10hz": time_to_flag(10.0)},
        "false_alarms_noisy_plateau": false_alarms(),
        "detect_growth_ms_20k_points": detect_cost_ms(),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
