"""What the prefill row writer's role (`req_write_extend`) costs on a CPU server, where SGLang's
`write_cache_indices` takes its fallback branch and the hooked `ReqToTokenPool.write` already gave
the ledger the same rows: the role applies them once more (probe/engines/sglang/prefill.py says why).

SGLang 0.5.23's own `alloc_for_extend` -> `write_cache_indices` over its real request pool,
allocator and radix tree (tests/support/prefill_batches.py: a batch of three requests prefilled
and finished into the tree, then three sharing their prefixes), timed around the prefill calls
only. Three arms, each in a fresh interpreter, alternating within one run: no probe; the probe
with this role made a no-op (every other hook as in a server); the whole probe. Ratios are
minimum over minimum.

    .venv/bin/python bench/bench_prefill_rows.py [--rounds 5] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arms import rounds_parser, run_arm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(REPO, "tests", "support")

ARM = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
arm, repeats, batches_per_loop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
probe = None
if arm != "off":
    from kvdoctor.probe.core import runtime
    if arm == "role-off":
        from kvdoctor.probe.core.hooks import Role
        from kvdoctor.probe.engines.sglang import prefill
        prefill.ReqWriteExtendRole.after = Role.after  # the base role's: nothing
    probe = runtime.activate(None)
from prefill_batches import PrefillBatches

def loop():
    spent = 0.0
    for _ in range(batches_per_loop):
        batches = PrefillBatches(1, "cpu", "torch_native")
        t0 = time.perf_counter()
        live = batches.run_two_batches()
        spent += time.perf_counter() - t0
        batches.finish(live)
    return spent

loop()  # warm-up
times = [loop() for _ in range(repeats)]
print("ARM " + json.dumps({"times_s": times, "hooked_calls": probe.calls if probe else 0}))
"""

ARMS = ("off", "role-off", "on")


def main() -> int:
    parser = rounds_parser(rounds=5, repeats=5)
    parser.add_argument("--batches", type=int, default=20, help="pairs of prefill batches per timed loop")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, SUPPORT]), "PYTHONWARNINGS": "ignore"}
    env.pop("KVDOCTOR_TRACE", None)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    calls: dict[str, int] = {}
    for _ in range(args.rounds):
        for arm in ARMS:
            out = run_arm([sys.executable, "-c", ARM, arm, str(args.repeats), str(args.batches)], env)
            times[arm] += out["times_s"]
            calls[arm] = out["hooked_calls"]
    best = {arm: min(t) for arm, t in times.items()}
    result = {
        "what": f"{args.batches} pairs of prefill batches (SGLang 0.5.23 alloc_for_extend -> write_cache_indices, CPU fallback branch)",
        "best_s": best,
        "hooked_calls_per_loop": {arm: calls[arm] // (args.repeats + 1) for arm in ARMS},
        "probe_over_off": best["on"] / best["off"],
        "role_over_role_off": best["on"] / best["role-off"],
        "loops_per_arm": len(times["off"]),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
