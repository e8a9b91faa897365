"""Anchors beside the probe's cost: tracemalloc and memray on the same allocator + tree workload,
each against the plain workload in the same run (fresh interpreters, alternating, medians)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

ARM = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
mode = sys.argv[1]
if mode == "tracemalloc":
    import tracemalloc; tracemalloc.start(1)
from kvdoctor.demo.workload import WorkloadConfig, run_workload
cfg = WorkloadConfig(page_size=1, conversations=32, turns=6, pool_tokens=4096)
run_workload(cfg)
times = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter(); run_workload(cfg); times.append(time.perf_counter() - t0)
print("ARM " + json.dumps(times))
"""


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arms import rounds_parser, run_arm  # noqa: E402


def arm(mode: str, repeats: int) -> list[float]:
    cmd = [sys.executable, "-c", ARM, mode, str(repeats)]
    if mode == "memray":
        out_file = tempfile.mktemp(suffix=".bin")
        cmd = [sys.executable, "-m", "memray", "run", "-q", "-o", out_file, "-c", ARM, mode, str(repeats)]
    return run_arm(cmd)


def main() -> None:
    args = rounds_parser().parse_args()
    modes = ["plain", "tracemalloc"]
    try:
        import memray  # noqa: F401

        modes.append("memray")
    except ImportError:
        pass
    times = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            times[mode] += arm(mode, args.repeats)
    plain = statistics.median(times["plain"])
    report = {m: {"loop_s": round(statistics.median(t), 5), "ratio": round(statistics.median(t) / plain, 3)} for m, t in times.items()}
    if "memray" not in modes:
        report["memray"] = "not installed (pip install memray)"
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
