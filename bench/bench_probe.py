"""Probe cost on SGLang's real allocator + radix tree multi-turn workload (CPU: no model work to
hide behind, the worst case). Loop time with the probe / without, measured in the same run:
each arm runs in its own fresh interpreter, alternating, and the medians are compared."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

ARM = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
with_probe = sys.argv[1] == "on"
page_size = int(sys.argv[2])
if with_probe:
    from kvdoctor.probe import runtime
    probe = runtime.activate(sys.argv[3])
from kvdoctor.demo.workload import Engine, WorkloadConfig, run_workload
cfg = WorkloadConfig(page_size=page_size, conversations=32, turns=6, pool_tokens=4096)
run_workload(cfg)  # warm-up
times = []
for _ in range(int(sys.argv[4])):
    t0 = time.perf_counter(); run_workload(cfg); times.append(time.perf_counter() - t0)
calls = 0
if with_probe:
    calls = probe.calls
    runtime.deactivate()
print("ARM " + json.dumps({"times_s": times, "hooked_calls": calls}))
"""


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arms import rounds_parser, run_arm  # noqa: E402


def probe_arm(arm: str, page_size: int, repeats: int, trace: str) -> dict:
    return run_arm([sys.executable, "-c", ARM, arm, str(page_size), trace, str(repeats)])


def main() -> None:
    args = rounds_parser().parse_args()
    report = {}
    tmp = tempfile.mkdtemp()
    for page_size in (1, 4):
        off_times, on_times, calls = [], [], 0
        for r in range(args.rounds):
            off_times += probe_arm("off", page_size, args.repeats, "")["times_s"]
            arm = probe_arm("on", page_size, args.repeats, os.path.join(tmp, f"p{page_size}-{r}.json"))
            on_times += arm["times_s"]
            calls = arm["hooked_calls"] // (args.repeats + 1)
        off, on = statistics.median(off_times), statistics.median(on_times)
        report[f"page_size_{page_size}"] = {
            "loop_s_without_probe": round(off, 5),
            "loop_s_with_probe": round(on, 5),
            "ratio": round(on / off, 3),
            "hooked_calls_per_loop": calls,
            "cost_per_hooked_call_us": round((on - off) / max(calls, 1) * 1e6, 2),
            "target_ratio": 1.10,
        }
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
