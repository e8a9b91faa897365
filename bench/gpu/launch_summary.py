"""The table of bench/gpu/run_launch.sh: per step size, the decode step off and on (the ledger's
kernels through Triton's launcher, launched compiled through Triton's launcher, through the CUDA
driver from Python (`direct`, `driver`) and from the native fast path (`c`); `c-w1` the same on one warp
a program), the ratios, the host time
the probe adds per hooked call and the GPU time it adds per step. Medians over the rounds.

    python bench/gpu/launch_summary.py graph_launch.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> None:
    runs: dict[tuple[int, int], dict[str, list[dict]]] = {}
    with open(path) as fh:
        for line in fh:
            row = json.loads(line)
            r = row["result"]
            runs.setdefault((r["layers"], r["hidden"]), {}).setdefault(row["mode"], []).append(r)
    table = []
    for (layers, hidden), modes in sorted(runs.items(), reverse=True):
        clean = {m: [r for r in rs if r.get("error") is None] for m, rs in modes.items()}
        med = {
            m: {k: statistics.median(r[k] for r in rs) for k in ("gpu_ms_per_step", "host_ms_per_step")} for m, rs in clean.items() if rs
        }
        off = med.get("off")
        if off is None:
            continue
        step_off = max(off["gpu_ms_per_step"], off["host_ms_per_step"])
        entry = {"step": f"{layers} x {hidden}", "off_ms": round(step_off, 4), "host_off_ms": round(off["host_ms_per_step"], 4)}
        # where the GPU is the slower side, the host's time per step includes the waits of a full
        # launch queue: its difference per call is then not the probe's own host time
        entry["host_bound"] = off["host_ms_per_step"] >= 0.95 * off["gpu_ms_per_step"]
        if "noop" in med:  # one tiny kernel a step, no probe: the floor of any launch per step
            step_noop = max(med["noop"]["gpu_ms_per_step"], med["noop"]["host_ms_per_step"])
            entry["noop_ratio"] = round(step_noop / step_off, 4)
            entry["noop_gpu_us_added_per_step"] = round((med["noop"]["gpu_ms_per_step"] - off["gpu_ms_per_step"]) * 1000, 2)
        # a launch path, or one with its kernels on fewer warps than Triton's 4 ("c-w1")
        known = ("triton", "compiled", "direct", "driver", "c")
        for mode in [m for m in med if m.split("-w")[0] in known]:
            calls = statistics.median(r["hooked_calls_per_step"] for r in clean[mode])
            step_on = max(med[mode]["gpu_ms_per_step"], med[mode]["host_ms_per_step"])
            entry[f"{mode}_ms"] = round(step_on, 4)
            entry[f"{mode}_ratio"] = round(step_on / step_off, 4)
            entry[f"{mode}_host_us_per_call"] = round((med[mode]["host_ms_per_step"] - off["host_ms_per_step"]) * 1000 / calls, 1)
            entry[f"{mode}_compiled_launches"] = sum(r.get("compiled_launches", 0) for r in modes[mode])
            entry[f"{mode}_driver_launches"] = sum(r.get("driver_launches", 0) for r in modes[mode])
            entry[f"{mode}_c_launches"] = sum(r.get("c_launches", 0) for r in modes[mode])
            # the ledger's kernels' time on the stream, per step (what the GPU side adds)
            entry[f"{mode}_gpu_us_added_per_step"] = round((med[mode]["gpu_ms_per_step"] - off["gpu_ms_per_step"]) * 1000, 2)
            entry[f"{mode}_errors"] = [r["error"] for r in modes[mode] if r.get("error")]
        table.append(entry)
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
