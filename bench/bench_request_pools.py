"""What the probe adds to a request pool's calls, in instructions: SGLang 0.5.23's classic
`ReqToTokenPool` against the hybrid model's `HybridReqToTokenPool` (a row and a Mamba state slot a
request, its `MambaPool` and `MambaSlotAllocator`), whose Mamba slots the probe judges (issue 49).

Each arm runs in its own interpreter under valgrind's callgrind, counting only the loop (the
scheduler's side of a request's life in the pool, batches of 8 of SGLang's own `Req`, made before
the count starts: `alloc`, then per request `free_mamba_cache` where the pool has one, and `free`) and only the main thread's.
Arms: no probe, and the probe with its native path. Reported per pool: the instructions a request
(its alloc, its frees) with and without the probe, their ratio, the hooked calls a request, and
the instructions a hooked call adds; the hybrid pool's against the classic one's.

    python bench/bench_request_pools.py [--requests 2048] [--out F]
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
from bench_probe_instructions import functions

ARM = r"""
import json, os, subprocess, sys, warnings
warnings.filterwarnings("ignore")
arm, kind, requests, trace = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
probe = None
if arm != "off":
    from kvdoctor.probe.core import runtime
    probe = runtime.activate(trace)
from array import array
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu", page_size=1))
if kind == "hybrid":
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4, state_size=4, conv_kernel=2)
    pool = HybridReqToTokenPool(size=64, mamba_size=64, mamba_spec_state_size=64, max_context_len=256, device="cpu",
        enable_memory_saver=False, cache_params=Mamba2CacheParams(shape=shape, layers=[0]), mamba_layer_ids=[0],
        enable_mamba_extra_buffer=False, enable_overlap_schedule=False)
else:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    pool = ReqToTokenPool(size=64, max_context_len=256, device="cpu", enable_memory_saver=False)
free_mamba = getattr(pool, "free_mamba_cache", None)

def new_req(n):
    req = Req(f"req-{n}", "", array("q", [1, 2, 3, 4]), SamplingParams(max_new_tokens=4, temperature=0))
    req.sampling_params.normalize(None)
    return req

def loop(reqs):
    for start in range(0, len(reqs), 8):
        batch = reqs[start : start + 8]
        pool.alloc(batch)
        for req in batch:
            if free_mamba is not None:
                free_mamba(req)
            pool.free(req)

def control(state):
    if os.environ.get("BENCH_CALLGRIND"):
        subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], stdout=subprocess.DEVNULL, check=True)

loop([new_req(i) for i in range(64)])  # warm-up
reqs = [new_req(i) for i in range(requests)]  # made before the count starts
calls0 = probe.calls if probe is not None else 0
control("on")
loop(reqs)
control("off")
calls = probe.calls - calls0 if probe is not None else 0
if probe is not None:
    runtime.deactivate()
print("ARM " + json.dumps({"hooked_calls": calls}))
"""

POOLS = ("classic", "hybrid")


def run_arm(arm: str, kind: str, requests: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{kind}-{arm}.cg")
    env = dict(os.environ, KVDOCTOR_NATIVE="1", OMP_NUM_THREADS="1", BENCH_CALLGRIND="1")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes", f"--callgrind-out-file={out}"]
    cmd += [sys.executable, "-c", ARM, arm, kind, str(requests), os.path.join(tmp, f"{kind}-{arm}.trace")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ARM ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_request_pools: the {kind} {arm} arm failed (rc {proc.returncode}): {proc.stderr.strip()[-600:]}")
    return {**json.loads(lines[-1][4:]), "instructions": sum(functions(out + "-01").values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2048, help="requests through the pool in the measured loop")
    parser.add_argument("--out", help="also write the JSON result here")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench_request_pools: needs valgrind (callgrind and callgrind_control): apt-get install valgrind")
    tmp = tempfile.mkdtemp()
    jobs = [(kind, arm) for kind in POOLS for arm in ("off", "compiled")]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = dict(zip(jobs, pool.map(lambda j: run_arm(j[1], j[0], args.requests, tmp), jobs), strict=True))
    report: dict = {"requests": args.requests}
    for kind in POOLS:
        off, on = done[(kind, "off")], done[(kind, "compiled")]
        calls = on["hooked_calls"]
        report[kind] = {
            "instructions_per_request": {"off": off["instructions"] // args.requests, "compiled": on["instructions"] // args.requests},
            "ratio": round(on["instructions"] / off["instructions"], 4),
            "hooked_calls_per_request": round(calls / args.requests, 2),
            "instructions_per_hooked_call": int((on["instructions"] - off["instructions"]) / max(calls, 1)),
        }
    report["hybrid_over_classic_per_hooked_call"] = round(
        report["hybrid"]["instructions_per_hooked_call"] / max(report["classic"]["instructions_per_hooked_call"], 1), 3
    )
    write_report(report, args.out)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
