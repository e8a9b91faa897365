"""Runs every benchmark, writes bench/results/<machine>.json, prints its table and regenerates the
docs' benchmark tables from it (docs/generate.py: docs/benchmarks.md; the README carries none)."""

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
        ("probe_cost_cpu", "bench_probe.py", ["--rounds", "2" if quick else "8", "--repeats", "3" if quick else "5"]),
        ("anchors_cpu", "bench_anchors.py", ["--rounds", "2" if quick else "3", "--repeats", "3" if quick else "5"]),
        (
            "probe_memory",
            "bench_probe_memory.py",
            ["--requests", "50000" if quick else "1000000", "--every", "10000" if quick else "100000"],
        ),
        ("replay", "bench_replay.py", ["--events", "300000" if quick else "2000000"]),
        ("watch", "bench_watch.py", ["--seconds", "10" if quick else "20"]),
        ("container_walk", "bench_containers.py", ["--batches", "12" if quick else "24"]),
        ("attribution_cost", "bench_attribution_memray.py", ["--rounds", "2" if quick else "3", "--repeats", "3" if quick else "5"]),
        ("memory_classes", "bench_memory_classes.py", ["--readings", "500" if quick else "2000"]),
        ("prefill_rows_cpu", "bench_prefill_rows.py", ["--rounds", "2" if quick else "3", "--repeats", "3" if quick else "10"]),
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
    # docs/benchmarks.md has a table for each bench/results/<machine>.json
    subprocess.run([sys.executable, os.path.join(ROOT, "docs", "generate.py")], check=True, cwd=ROOT)


def _probe_rows(page_size: int, p: dict, loop: str = "allocator + tree loop") -> list[tuple[str, str, str]]:
    """The probe's ratio with the floor beside it: a bare pass-through wrapper on the same methods."""
    name = f"probe cost, {loop}, page_size {page_size} (CPU)"
    measured = f"{p['ratio']}x ({p['cost_per_hooked_call_us']} us/hooked call"
    measured += f"; rounds' own ratios, median {p['ratio_paired_median']}x)" if "ratio_paired_median" in p else ")"
    if "floor_ratio_bare_wrapper" not in p:
        return [(name, measured, "<= 1.10x")]
    return [
        (name, f"{measured}, {p['ratio_over_floor']}x the floor", "<= 1.10x"),
        (f"  floor: bare pass-through wrapper, page_size {page_size}", f"{p['floor_ratio_bare_wrapper']}x", "-"),
        (f"  without the native path (pure Python), page_size {page_size}", f"{p['python_fallback_ratio']}x", "-"),
    ]


def table(r: dict) -> str:
    p1, p4 = r["probe_cost_cpu"]["page_size_1"], r["probe_cost_cpu"]["page_size_4"]
    anchors = r["anchors_cpu"]
    mem = r["probe_memory"]
    rep = r["replay"]
    watch = r["watch"]
    tree_heavy = [
        row
        for ps in (1, 4)
        if f"tree_heavy_page_size_{ps}" in r["probe_cost_cpu"]
        for row in _probe_rows(ps, r["probe_cost_cpu"][f"tree_heavy_page_size_{ps}"], "tree-heavy loop")
    ]
    rows = [
        *_probe_rows(1, p1),
        *_probe_rows(4, p4),
        *tree_heavy,
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
            f"{rep['events_per_s'] / 1e6:.2f} M events/s, peak RSS {rep['peak_rss_bytes'] / 2**20:.0f} MiB"
            + (f" (+ {rep['peak_rss_reader_bytes'] / 2**20:.0f} MiB reader process)" if rep.get("peak_rss_reader_bytes") else "")
            + f" for a {rep['trace_bytes'] / 2**20:.0f} MiB trace",
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
    attribution = r.get("attribution_cost")
    if isinstance(attribution, dict) and "memray" in attribution:
        for engine in ("memray", "tracemalloc"):
            a = attribution[engine]
            rows.append(
                (
                    f"attribution window open, {engine} (over the probe alone)",
                    f"{a['window_ratio_over_probe']}x; {a['average_ratio_over_probe_at_duty_cycle']}x at the default duty cycle",
                    "-",
                )
            )
        pause = attribution["memray_edge_pause_s"]
        rows.append(("memray window edges (GIL held)", f"{pause['start'] * 1000:.0f} ms start, {pause['stop'] * 1000:.0f} ms stop", "-"))
    walk = r.get("container_walk")
    if isinstance(walk, dict) and "walk_us_median" in walk:
        rows.append(
            (
                "container walk, vLLM 0.32 KVCacheManager (writer thread)",
                f"{walk['walk_us_median']:.1f} us median, {walk['walk_us_max']:.1f} us max; {walk['cpu_percent_of_one_core']}% of one core at 1 walk / {walk['period_s']:g} s",
                "-",
            )
        )
    classes = r.get("memory_classes")
    if isinstance(classes, dict) and "fresh" in classes:
        for heap in ("fresh", "python_heap", "fragmented_malloc"):
            m = classes[heap]
            verdict = "; over budget: the readings turn off" if m["over_budget"] else ""
            rows.append(
                (
                    f"memory-class reading, {m['python_blocks'] / 1e6:.1f} M Python blocks, {m['malloc_free_chunks']:,} free malloc chunks",
                    f"{m['reading_cpu_median_us']} us CPU, {m['percent_of_one_core_at_1s']}% of one core at 1 s{verdict}",
                    f"<= {m['budget_ms']:g} ms a reading",
                )
            )
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
