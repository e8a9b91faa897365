"""What host growth attribution costs a server-like loop: SGLang's real allocator + radix tree
multi-turn workload, with the probe, and with the probe and an attribution window open all the
time (memray, memray with native frames, tracemalloc). Each arm in a fresh interpreter,
alternating, medians. A window's cost only applies while it is open, so the average cost is
1 + (ratio - 1) x duty cycle (window_s / period_s: 5 s every 30 s by default). Also measured: the
pause at each memray window's edges (the tracker patches every loaded library's allocator entries
when it starts and restores them when it stops, holding the GIL)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

ARM = r"""
import json, os, sys, tempfile, threading, time, tracemalloc, warnings
warnings.filterwarnings("ignore")
arm, trace, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
from kvdoctor.demo.workload import WorkloadConfig, run_workload
probe = None
if arm != "off":
    from kvdoctor.probe.core import runtime
    probe = runtime.activate(trace)
cfg = WorkloadConfig(page_size=1, conversations=32, turns=6, pool_tokens=4096)
run_workload(cfg)  # warm-up (and every hooked module imported)

def window_open():
    if arm.startswith("memray"):
        return getattr(threading, "_profile_hook", None) is not None  # memray's tracker sets it
    if arm == "tracemalloc":
        return tracemalloc.is_tracing()
    return True

deadline = time.monotonic() + 30
while not window_open() and time.monotonic() < deadline:
    time.sleep(0.05)
assert window_open(), "the attribution window did not open"
times = []
for _ in range(repeats):
    t0 = time.perf_counter(); run_workload(cfg); times.append(time.perf_counter() - t0)
assert window_open(), "the attribution window closed while the loop was timed"
edges = []
if arm == "probe":
    import memray
    for k in range(3):
        path = os.path.join(tempfile.mkdtemp(), "edge.bin")
        tracker = memray.Tracker(path, memory_interval_ms=1000, file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS)
        t0 = time.perf_counter(); tracker.__enter__(); t1 = time.perf_counter()
        tracker.__exit__(None, None, None); t2 = time.perf_counter()
        edges.append([t1 - t0, t2 - t1])
print("ARM " + json.dumps({"times_s": times, "edges_s": edges}))
os._exit(0)  # the open window is not read: only the loop was measured
"""

WINDOW_OPEN_ALL_RUN = {"KVDOCTOR_ATTRIBUTION_PERIOD_S": "100000", "KVDOCTOR_ATTRIBUTION_WINDOW_S": "100000"}
ARMS: dict[str, dict[str, str]] = {
    "off": {},
    "probe": {},
    "memray": {"KVDOCTOR_ATTRIBUTION": "memray", **WINDOW_OPEN_ALL_RUN},
    "memray-native": {"KVDOCTOR_ATTRIBUTION": "memray", "KVDOCTOR_ATTRIBUTION_MEMRAY_NATIVE": "1", **WINDOW_OPEN_ALL_RUN},
    "tracemalloc": {"KVDOCTOR_ATTRIBUTION": "tracemalloc", **WINDOW_OPEN_ALL_RUN},
}

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arms import rounds_parser, run_arm  # noqa: E402


def main() -> None:
    args = rounds_parser(rounds=3, repeats=8).parse_args()
    from kvdoctor.probe.readings.attribution import DEFAULT_PERIOD_S, DEFAULT_WINDOW_S

    tmp = tempfile.mkdtemp()
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    edges: list[list[float]] = []
    for r in range(args.rounds):
        for arm, extra in ARMS.items():
            env = dict(os.environ, **extra)
            env.pop("KVDOCTOR_TRACE", None)
            if "KVDOCTOR_ATTRIBUTION" not in extra:
                env.pop("KVDOCTOR_ATTRIBUTION", None)
            result = run_arm([sys.executable, "-c", ARM, arm, os.path.join(tmp, f"{arm}-{r}.json"), str(args.repeats)], env=env)
            times[arm] += result["times_s"]
            edges += result["edges_s"]
    loop = {arm: statistics.median(t) for arm, t in times.items()}
    duty = DEFAULT_WINDOW_S / DEFAULT_PERIOD_S
    report: dict = {
        "loop_s": {arm: round(s, 5) for arm, s in loop.items()},
        "probe_ratio_over_off": round(loop["probe"] / loop["off"], 3),
        "duty_cycle": round(duty, 4),
        "memray_edge_pause_s": {
            "start": round(statistics.median(e[0] for e in edges), 4),
            "stop": round(statistics.median(e[1] for e in edges), 4),
        },
    }
    for arm in ("memray", "memray-native", "tracemalloc"):
        ratio = loop[arm] / loop["probe"]
        report[arm] = {
            "window_ratio_over_probe": round(ratio, 3),
            "window_ratio_over_off": round(loop[arm] / loop["off"], 3),
            "average_ratio_over_probe_at_duty_cycle": round(1 + (ratio - 1) * duty, 3),
        }
    m = report["memray"]
    report["figure"] = (
        f"attribution windows with memray: {m['window_ratio_over_probe']}x on the loop (over the probe alone) "
        f"/ duty cycle {duty:.0%} ({DEFAULT_WINDOW_S:g} s every {DEFAULT_PERIOD_S:g} s) = {m['average_ratio_over_probe_at_duty_cycle']}x on average; "
        f"{report['memray_edge_pause_s']['start'] * 1000:.0f} + {report['memray_edge_pause_s']['stop'] * 1000:.0f} ms pause at a window's start and end"
    )
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
