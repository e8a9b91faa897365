"""The probe's own memory over a long run through the real classes: it must be bounded and flat.

Counts what the probe holds (ledger arrays, interned call sites, request table, emitter buffer,
HiCache view registry) every `--every` requests, and the process's RSS beside it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")


def probe_bytes(probe) -> int:
    from kvdoctor.probe.engines.sglang.state import sglang_state

    sglang = sglang_state(probe)
    total = 0
    for ledger in sglang.ledgers.values():
        for name in ("state", "owner", "alloc_site", "flags", "violation_site", "counters", "oor_value"):
            arr = getattr(ledger, name)
            total += int(arr.nbytes) if hasattr(arr, "nbytes") else int(arr.numel() * arr.element_size())
    total += sum(len(s) for s in probe.sites.names) + 120 * len(probe.sites.names)
    total += 100 * (len(sglang.requests.live) + len(sglang.requests.finished))
    total += 400 * len(probe.emitter.buffer) + 100 * len(probe.sites._quick) + 200 * len(sglang.last_loc_sources)
    views = getattr(probe.states.get("hicache"), "views", {})
    total += 200 * len(views)
    return total


def rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=100_000)
    parser.add_argument("--out")
    args = parser.parse_args()
    from kvdoctor.probe.core import runtime

    trace = tempfile.mktemp(suffix=".kvtrace.json")
    probe = runtime.activate(trace)
    from kvdoctor.demo.workload import Engine, WorkloadConfig, run_workload

    cfg = WorkloadConfig(conversations=64, turns=4, batch=8, user_tokens=8, output_tokens=2, pool_tokens=8192)
    engine = Engine(cfg.pool_tokens, cfg.page_size, max_requests=64)
    per_loop = cfg.conversations * cfg.turns
    samples = []
    done = 0
    t0 = time.time()
    seed = 0
    while done < args.requests:
        run_workload(WorkloadConfig(**{**cfg.__dict__, "seed": seed}), engine)
        engine.tree.reset()
        engine.allocator.clear()
        seed += 1
        done += per_loop
        if done // args.every != (done - per_loop) // args.every:
            samples.append(
                {
                    "requests": done,
                    "probe_bytes": probe_bytes(probe),
                    "rss_bytes": rss_bytes(),
                    "trace_bytes": os.path.getsize(trace) if os.path.exists(trace) else 0,
                    "elapsed_s": round(time.time() - t0, 1),
                }
            )
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
    runtime.deactivate()
    first, last = samples[0], samples[-1]
    report = {
        "requests": done,
        "hooked_calls": probe.calls,
        "samples": samples,
        "probe_bytes_final": last["probe_bytes"],
        "probe_bytes_growth_after_first_sample": last["probe_bytes"] - first["probe_bytes"],
        "rss_growth_after_first_sample_bytes": last["rss_bytes"] - first["rss_bytes"],
        "target_probe_bytes": 64 << 20,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
    os.remove(trace)


if __name__ == "__main__":
    main()
