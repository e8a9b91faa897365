"""Runs every benchmark, writes bench/results/<machine>.json and prints the table for the README."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def machine_name() -> str:
    return f"{platform.machine()}-{os.cpu_count()}cpu-py{sys.version_info.major}.{sys.version_info.minor}"


def run_json(script: str, *args: str) -> dict:
    out = tempfile.mktemp(suffix=".json")
    t0 = time.time()
    subprocess.run([sys.executable, os.path.join(HERE, script), *args, "--out", out], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(out) as fh:
        result = json.load(fh)
    result["_bench_seconds"] = round(time.time() - t0, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick = args.quick
    results: dict = {
        "machine": machine_name(),
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "quick": quick,
    }
    steps = [
        ("probe_cost_cpu", "bench_probe.py", ["--rounds", "2" if quick else "3", "--repeats", "3" if quick else "5"]),
        ("anchors_cpu", "bench_anchors.py", ["--rounds", "2" if quick else "3", "--repeats", "3" if quick else "5"]),
        (
            "probe_memory",
            "bench_probe_memory.py",
            ["--requests", "50000" if quick else "1000000", "--every", "10000" if quick else "100000"],
        ),
        ("replay", "bench_replay.py", ["--events", "300000" if quick else "2000000"]),
        ("watch", "bench_watch.py", ["--seconds", "10" if quick else "20"]),
    ]
    for key, script, extra in steps:
        print(f"bench: {key} ...", file=sys.stderr, flush=True)
        results[key] = run_json(script, *extra)
    gpu = os.path.join(ROOT, "reports", "gpu", "results.json")
    if os.path.exists(gpu):
        with open(gpu) as fh:
            results["gpu_machine"] = json.load(fh)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", f"{results['machine']}.json")
    with open(path, "w") as fh:
        json.dump(results, fh, indent=2)
    print(table(results))
    print(f"\nwritten: {os.path.relpath(path, ROOT)}")


def table(r: dict) -> str:
    p1, p4 = r["probe_cost_cpu"]["page_size_1"], r["probe_cost_cpu"]["page_size_4"]
    anchors = r["anchors_cpu"]
    mem = r["probe_memory"]
    rep = r["replay"]
    watch = r["watch"]
    rows = [
        (
            "probe cost, allocator + tree loop, page_size 1 (CPU)",
            f"{p1['ratio']}x ({p1['cost_per_hooked_call_us']} us/hooked call)",
            "<= 1.10x",
        ),
        (
            "probe cost, allocator + tree loop, page_size 4 (CPU)",
            f"{p4['ratio']}x ({p4['cost_per_hooked_call_us']} us/hooked call)",
            "<= 1.10x",
        ),
        ("anchor: tracemalloc on the same loop", f"{anchors['tracemalloc']['ratio']}x", "-"),
        (
            "anchor: memray on the same loop",
            f"{anchors['memray']['ratio']}x" if isinstance(anchors.get("memray"), dict) else str(anchors.get("memray")),
            "-",
        ),
        (
            f"probe memory after {mem['requests']:,} requests",
            f"{mem['probe_bytes_final'] / 1024:.0f} KiB, growth {mem['probe_bytes_growth_after_first_sample']} B",
            "<= 64 MiB, flat",
        ),
        (
            "replay throughput",
            f"{rep['events_per_s'] / 1e6:.2f} M events/s, peak RSS {rep['peak_rss_bytes'] / 2**20:.0f} MiB for a {rep['trace_bytes'] / 2**20:.0f} MiB trace",
            ">= 1 M events/s",
        ),
        ("watch at 10 Hz, 4-process tree", f"{watch['watcher_cpu_10hz_4proc']['cpu_percent_of_one_core']}% of one core", "<= 2%"),
        (
            "time to flag 10 GB/h after warm-up",
            f"{watch['time_to_flag_10gb_per_h_s']['1hz']} s at 1 Hz, {watch['time_to_flag_10gb_per_h_s']['10hz']} s at 10 Hz",
            "<= 120 s",
        ),
        (
            "false alarms on noisy plateaus",
            f"{watch['false_alarms_noisy_plateau']['runs_flagged_at_any_check']} of {watch['false_alarms_noisy_plateau']['runs']}",
            "0",
        ),
    ]
    gpu = r.get("gpu_machine")
    if isinstance(gpu, dict):
        for row in gpu.get("table", []):
            name, value, target = (list(row) + ["", ""])[:3]
            rows.append((name + " (GPU machine)", value, target))
    width = max(len(a) for a, _, _ in rows)
    lines = [f"| {'figure':<{width}} | measured | target |", f"|{'-' * (width + 2)}|---|---|"]
    lines += [f"| {a:<{width}} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
