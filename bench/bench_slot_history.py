"""The slot ledgers' flight recorder's cost: instructions per hooked call with it on against off.

Each arm runs bench_probe.py's loops under valgrind's callgrind, as bench_probe_instructions.py
does (instructions retired by the loop's thread, the same from run to run; the clock's swings on
a shared machine hide a 1 % change). Arms, all in the same run: no probe; the probe on its native
path with the recorder off (KVDOCTOR_SLOT_HISTORY=0); the same with it on (the default, 8 entries
a page); with --python, the pure-Python path both ways too. Reported per shape and page size: the
loop's instructions, the recorder's ratio (on / off, the probed process both times), the probe's
ratio to no probe both ways, the instructions the recorder adds per hooked call, and the bytes it
holds per page and for a million-page pool.

    python bench/bench_slot_history.py [--shapes allocator_loop,tree_heavy] [--page-sizes 1,4] [--python] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arms import write_report

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_probe import SHAPES, page_sizes
from bench_probe_instructions import ARM, INTERVALS, SLOWDOWN, functions

from kvdoctor.probe.ledgers.history import DEFAULT_ENTRIES, bytes_per_page

ARMS = {
    "off": ("off", {}),
    "recorder_off": ("compiled", {"KVDOCTOR_NATIVE": "1", "KVDOCTOR_SLOT_HISTORY": "0"}),
    "recorder_on": ("compiled", {"KVDOCTOR_NATIVE": "1"}),
    "python_recorder_off": ("compiled", {"KVDOCTOR_NATIVE": "0", "KVDOCTOR_SLOT_HISTORY": "0"}),
    "python_recorder_on": ("compiled", {"KVDOCTOR_NATIVE": "0"}),
}


def run_arm(name: str, page_size: int, shape: str, loops: int, tmp: str) -> dict:
    arm, extra = ARMS[name]
    out = os.path.join(tmp, f"{shape}-{page_size}-{name}.cg")
    env = {k: v for k, v in os.environ.items() if k != "KVDOCTOR_SLOT_HISTORY"}  # the arm says whether it records
    env.update({k: str(v * SLOWDOWN) for k, v in INTERVALS.items()}, OMP_NUM_THREADS="1", **extra)
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes", f"--callgrind-out-file={out}", sys.executable]
    cmd += ["-c", ARM, arm, str(page_size), os.path.join(tmp, f"{shape}-{page_size}-{name}.trace"), str(loops), json.dumps(SHAPES[shape])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ARM ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_slot_history: the {name} arm failed (rc {proc.returncode}): {proc.stderr.strip()[-400:]}")
    return {**json.loads(lines[-1][4:]), "instructions": sum(functions(out + "-01").values()) / loops}


def compare(arms: dict[str, dict], loops: int, prefix: str = "") -> dict:
    base, off, on = arms["off"]["instructions"], arms[prefix + "recorder_off"], arms[prefix + "recorder_on"]
    calls = on["hooked_calls"] / loops
    return {
        "instructions_per_loop": {"no_probe": int(base), "recorder_off": int(off["instructions"]), "recorder_on": int(on["instructions"])},
        "recorder_ratio_on_over_off": round(on["instructions"] / off["instructions"], 4),
        "probe_ratio_recorder_off": round(off["instructions"] / base, 4),
        "probe_ratio_recorder_on": round(on["instructions"] / base, 4),
        "hooked_calls_per_loop": int(calls),
        "recorder_instructions_per_hooked_call": round((on["instructions"] - off["instructions"]) / max(calls, 1), 1),
        "native_path_loaded": on["compiled"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--page-sizes", default="1,4")
    parser.add_argument("--loops", type=int, default=2, help="measured loops per arm (after one warm-up)")
    parser.add_argument("--python", action="store_true", help="the pure-Python path's arms too")
    parser.add_argument("--out", help="also write the JSON result here")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench_slot_history: needs valgrind (callgrind and callgrind_control): apt-get install valgrind")
    tmp = tempfile.mkdtemp()
    names = [n for n in ARMS if args.python or not n.startswith("python")]
    configs = [(s, p) for s in args.shapes.split(",") for p in page_sizes(s, tuple(int(p) for p in args.page_sizes.split(",")))]
    jobs = [(shape, ps, name) for shape, ps in configs for name in names]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = dict(zip(jobs, pool.map(lambda j: run_arm(j[2], j[1], j[0], args.loops, tmp), jobs), strict=True))
    report: dict = {
        "memory": {
            "entries_per_page": DEFAULT_ENTRIES,
            "bytes_per_page": bytes_per_page(DEFAULT_ENTRIES),
            "bytes_for_a_million_pages": bytes_per_page(DEFAULT_ENTRIES) * 1_000_000,
        }
    }
    for shape, ps in configs:
        arms = {name: done[(shape, ps, name)] for name in names}
        report[f"{shape}_page_size_{ps}"] = compare(arms, args.loops)
        if args.python:
            report[f"{shape}_page_size_{ps}_python_path"] = compare(arms, args.loops, "python_")
    write_report(report, args.out)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
