"""The probe's cost on bench_probe.py's loops in instructions, not seconds, and where they go.

On a shared 2-core machine one loop's time swings by 5-15 % between runs of the same code, so a
ratio of 1.03x cannot be told from 1.08x by the clock. Instructions retired by the scheduler's
thread are the same from run to run: each arm runs under valgrind's callgrind in its own
interpreter, counting only while the measured loops run (`callgrind_control -i on/off`), and only
the main thread's (the probe's writer thread is counted apart). Arms: no probe; a bare pass-through
wrapper on the methods the probe hooks (the floor); the probe with its native path.

Instructions are not time: cache misses and branch mispredictions are not in them, so the clock's
ratio runs higher (bench_probe.py). What this gives is a ratio that does not drift, and the
functions whose instructions the probe adds, grouped by where their code lives.

valgrind runs the loop about 50 times slower than the CPU, and the probe's censuses and its writer
thread's rounds (each of which takes the interpreter's lock from the loop's thread) are timed by the
clock, so each interval is stretched by SLOWDOWN: per loop they come as often as in a real run. torch
runs one thread (OMP_NUM_THREADS=1): its pool's threads spin while they wait, and how long they wait
is the clock's, which made the paged loop's count move by 0.5 % between runs.

    python bench/bench_probe_instructions.py [--shapes tree_heavy] [--page-sizes 1] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arms import write_report
from bench_probe import ARM_SETUP, SHAPES, page_sizes

SLOWDOWN = 50  # valgrind's callgrind on this loop, roughly
# the defaults of what the probe times by the clock: its censuses and its writer thread's rounds
INTERVALS = {"KVDOCTOR_IDLE_CENSUS_INTERVAL_S": 2.0, "KVDOCTOR_ROLLING_CENSUS_S": 5.0, "KVDOCTOR_WRITER_INTERVAL_S": 0.5}

ARM = (
    ARM_SETUP
    + r"""
import subprocess
run_workload(cfg)  # warm-up
calls0 = probe.calls if probe is not None else 0
def control(state):
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], stdout=subprocess.DEVNULL, check=True)
control("on")
for _ in range(repeats):
    run_workload(cfg)
control("off")
calls, compiled = 0, False
if probe is not None:
    calls, compiled = probe.calls - calls0, native.NATIVE is not None
    runtime.deactivate()
print("ARM " + json.dumps({"hooked_calls": calls, "compiled": compiled}))
"""
)

# where a function's code lives, by the object file callgrind names
GROUPS = (
    ("_native", "probe's native path"),
    ("libpython", "interpreter"),
    ("torch", "torch"),
    ("libc10", "torch"),
    ("numpy", "numpy"),
    ("_multiarray", "numpy"),
    ("libc.so", "libc"),
    ("ld-linux", "libc"),
)


def functions(path: str) -> dict[str, int]:
    """Self instructions per function of one callgrind file."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no", path], capture_output=True, text=True, check=True).stdout
    costs: dict[str, int] = {}
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+) \([ \d.]+%\)\s+(.*)$", line)
        if m and "PROGRAM TOTALS" not in m.group(2):
            costs[m.group(2)] = costs.get(m.group(2), 0) + int(m.group(1).replace(",", ""))
    return costs


def group_of(name: str) -> str:
    obj = m.group(1) if (m := re.search(r"\[([^\]]*)\]\s*$", name)) else name
    for needle, group in GROUPS:
        if needle in obj:
            return group
    return "interpreter" if "Python-3" in name else "other"


def function_name(name: str) -> str:
    """A function by its name alone: the same code is named from either of two torch libraries, and
    the eval loop under the names of what it inlined."""
    where, _, function = re.sub(r"\s*\[[^\]]*\]\s*$", "", name).partition(":")
    if where.endswith("/ceval.c") or function.startswith("_PyEval_EvalFrameDefault"):
        return "the interpreter's eval loop (ceval.c)"
    return re.sub(r"'\d+$", "", function or where)


def run_arm(arm: str, page_size: int, shape: str, loops: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{shape}-{page_size}-{arm}.cg")
    # one torch thread: under valgrind its pool's threads would spin for as long as the loop waits
    env = dict(os.environ, **{k: str(v * SLOWDOWN) for k, v in INTERVALS.items()}, KVDOCTOR_NATIVE="1", OMP_NUM_THREADS="1")
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--separate-threads=yes",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-c",
        ARM,
        arm,
        str(page_size),
        os.path.join(tmp, f"{shape}-{page_size}-{arm}.trace"),
        str(loops),
        json.dumps(SHAPES[shape]),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ARM ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_probe_instructions: the {arm} arm failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}")
    main_thread = out + "-01"  # callgrind's first thread: the one that ran the loop
    return {**json.loads(lines[-1][4:]), "functions": functions(main_thread)}


def compare(arms: dict[str, dict], loops: int, top: int) -> dict:
    total = {arm: sum(r["functions"].values()) / loops for arm, r in arms.items()}
    by_function: dict[str, dict[str, float]] = {"off": {}, "compiled": {}}
    group: dict[str, str] = {}
    for arm, costs in by_function.items():
        for name, cost in arms[arm]["functions"].items():
            costs[function_name(name)] = costs.get(function_name(name), 0) + cost
            group.setdefault(function_name(name), group_of(name))
    off, on = by_function["off"], by_function["compiled"]
    added = {name: (on.get(name, 0) - off.get(name, 0)) / loops for name in set(off) | set(on)}
    groups: dict[str, float] = {}
    for name, cost in added.items():
        groups[group[name]] = groups.get(group[name], 0) + cost
    calls = arms["compiled"]["hooked_calls"] / loops
    return {
        "instructions_per_loop": {arm: int(v) for arm, v in total.items()},
        "ratio": round(total["compiled"] / total["off"], 4),
        "floor_ratio_bare_wrapper": round(total["bare"] / total["off"], 4),
        "hooked_calls_per_loop": int(calls),
        "native_path_loaded": arms["compiled"]["compiled"],
        "instructions_per_hooked_call": int((total["compiled"] - total["off"]) / max(calls, 1)),
        "added_by_group": {g: int(v) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "added_by_function": [[n, group[n], int(v)] for n, v in sorted(added.items(), key=lambda kv: -kv[1])[:top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--page-sizes", default="1,4")
    parser.add_argument("--loops", type=int, default=2, help="measured loops per arm (after one warm-up)")
    parser.add_argument("--top", type=int, default=15, help="functions listed by the instructions the probe adds")
    parser.add_argument("--out", help="also write the JSON result here")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench_probe_instructions: needs valgrind (callgrind and callgrind_control): apt-get install valgrind")
    tmp = tempfile.mkdtemp()
    configs = [(s, p) for s in args.shapes.split(",") for p in page_sizes(s, tuple(int(p) for p in args.page_sizes.split(",")))]
    jobs = [(shape, ps, arm) for shape, ps in configs for arm in ("off", "bare", "compiled")]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = dict(zip(jobs, pool.map(lambda j: run_arm(j[2], j[1], j[0], args.loops, tmp), jobs), strict=True))
    report = {
        f"{shape}_page_size_{ps}": compare({arm: done[(shape, ps, arm)] for arm in ("off", "bare", "compiled")}, args.loops, args.top)
        for shape, ps in configs
    }
    write_report(report, args.out)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
