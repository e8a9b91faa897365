"""Probe cost on SGLang's real allocator + radix tree multi-turn workload (CPU: no model work to
hide behind, the worst case), in two shapes: the allocator loop (17 decode allocations and 18 row
writes a request) and a tree-heavy loop (short answers on a small pool: 3 allocations a request,
and an insert and 0.8 evictions each, so the tree's calls are 13 % of the hooked calls, not 4 %). Four arms, each in its own fresh interpreter, alternating within
one run: no probe; a bare pass-through wrapper on exactly the methods the probe hooks (the floor:
what any wrapper costs); the probe with its native path; the probe in pure Python
(KVDOCTOR_NATIVE=0, the fallback where the extension is not built). Ratios are minimum over
minimum (the least disturbed loop of each arm), medians beside them, and the median over rounds of
each round's own ratio (arms of one round run back to back, so a drift in the machine's speed
between rounds cancels)."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

# What every arm runs first, here and in bench_probe_instructions.py: the probe (or none), the loop's
# config and, for the bare arm, each method the probe hooks behind a pass-through wrapper that only
# calls the original. It leaves `probe`, `cfg`, `run_workload` and `repeats` set.
ARM_SETUP = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
arm, page_size, trace, repeats, shape = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
probe = None
if arm != "off":
    from kvdoctor.probe import native
    from kvdoctor.probe.core import runtime
    probe = runtime.activate(trace)
from kvdoctor.demo.workload import WorkloadConfig, run_workload
cfg = WorkloadConfig(page_size=page_size, **shape)
if arm == "bare":
    # the same methods, each behind a pass-through wrapper that only calls the original
    import functools, importlib
    run_workload(cfg)  # imports (and so hooks) every module the loop uses
    def passthrough(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            return original(*args, **kwargs)
        return wrapper
    hooked = 0
    for spec in probe.maps["sglang"].classes:
        cls = getattr(importlib.import_module(spec.module), spec.cls, None)
        for method in spec.methods:
            wrapped = cls.__dict__.get(method) if cls is not None else None
            if wrapped is not None and hasattr(wrapped, "__wrapped__"):
                setattr(cls, method, passthrough(wrapped.__wrapped__))
                hooked += 1
    runtime.deactivate()
    probe = None
    assert hooked, "no hooked methods to strip"
"""

ARM = (
    ARM_SETUP
    + r"""
run_workload(cfg)  # warm-up
times = []
for _ in range(repeats):
    t0 = time.perf_counter(); run_workload(cfg); times.append(time.perf_counter() - t0)
calls, compiled = 0, False
if probe is not None:
    calls, compiled = probe.calls, native.NATIVE is not None
    runtime.deactivate()
print("ARM " + json.dumps({"times_s": times, "hooked_calls": calls, "compiled": compiled}))
"""
)

# name -> WorkloadConfig fields; the report's keys are page_size_N (the first) and NAME_page_size_N
SHAPES = {
    "allocator_loop": {"conversations": 32, "turns": 6, "pool_tokens": 4096},
    "tree_heavy": {"conversations": 64, "turns": 3, "output_tokens": 2, "batch": 4, "pool_tokens": 2048},
    # the allocator loop over the 0.5.19+ default tree (UnifiedRadixCache), the sliding-window loop's own comparator
    "unified_loop": {"conversations": 32, "turns": 6, "pool_tokens": 4096, "tree": "unified"},
    # and over a sliding-window pool (SWATokenToKVPoolAllocator: two sides, each a hooked token allocator
    # under the hooked composite) with the tree's FULL and SWA components: one-slot pages only
    "swa_loop": {"conversations": 32, "turns": 6, "pool_tokens": 4096, "tree": "swa"},
}
PAGE_SIZES = {"swa_loop": (1,)}  # the page sizes a shape runs at, where not 1 and 4


def page_sizes(shape: str, asked: tuple[int, ...] = (1, 4)) -> list[int]:
    return [p for p in asked if p in PAGE_SIZES.get(shape, asked)]


ARMS = {"off": {}, "bare": {}, "compiled": {"KVDOCTOR_NATIVE": "1"}, "python": {"KVDOCTOR_NATIVE": "0"}}

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arms import rounds_parser, run_arm, write_report  # noqa: E402


def probe_arm(arm: str, page_size: int, repeats: int, trace: str, shape: str) -> dict:
    env = dict(os.environ, **ARMS[arm])
    return run_arm([sys.executable, "-c", ARM, arm, str(page_size), trace, str(repeats), json.dumps(SHAPES[shape])], env=env)


def main() -> None:
    parser = rounds_parser()
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args()
    report: dict = {}
    tmp = tempfile.mkdtemp()
    first = next(iter(SHAPES))
    for shape, page_size in [(s, p) for s in args.shapes.split(",") for p in page_sizes(s)]:
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        paired: list[float] = []  # per round: its compiled minimum over its unprobed minimum
        calls, compiled = 0, None
        for r in range(args.rounds):
            best_in_round = {}
            for arm in ARMS:
                result = probe_arm(arm, page_size, args.repeats, os.path.join(tmp, f"{shape}-p{page_size}-{arm}-{r}.json"), shape)
                times[arm] += result["times_s"]
                best_in_round[arm] = min(result["times_s"])
                if arm == "compiled":
                    calls = result["hooked_calls"] // (args.repeats + 1)
                    compiled = result["compiled"]
            paired.append(best_in_round["compiled"] / best_in_round["off"])
        best = {arm: min(t) for arm, t in times.items()}
        median = {arm: statistics.median(t) for arm, t in times.items()}
        off = best["off"]
        report[f"page_size_{page_size}" if shape == first else f"{shape}_page_size_{page_size}"] = {
            "shape": shape,
            "loop_s_min": {arm: round(v, 5) for arm, v in best.items()},
            "loop_s_median": {arm: round(v, 5) for arm, v in median.items()},
            "ratio": round(best["compiled"] / off, 3),
            "ratio_median": round(median["compiled"] / median["off"], 3),
            # the machine's speed drifts between rounds; arms of one round ran back to back
            "ratio_paired_median": round(statistics.median(paired), 3),
            "ratio_paired_per_round": [round(x, 3) for x in paired],
            "floor_ratio_bare_wrapper": round(best["bare"] / off, 3),
            "ratio_over_floor": round(best["compiled"] / best["bare"], 3),
            "python_fallback_ratio": round(best["python"] / off, 3),
            "native_path_loaded": compiled,
            "hooked_calls_per_loop": calls,
            "cost_per_hooked_call_us": round((best["compiled"] - off) / max(calls, 1) * 1e6, 2),
            "floor_cost_per_hooked_call_us": round((best["bare"] - off) / max(calls, 1) * 1e6, 2),
            "python_cost_per_hooked_call_us": round((best["python"] - off) / max(calls, 1) * 1e6, 2),
            "target_ratio": 1.10,
        }
    write_report(report, args.out)


if __name__ == "__main__":
    main()
