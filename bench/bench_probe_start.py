"""What the probe costs a Python process under `kvdoctor run` that never imports an engine (shell
helpers, compilers, tokenizer workers): `python -c pass` with and without the probe's environment,
alternating in one run, and the same for a process that imports SGLang's allocator module.

    .venv/bin/python bench/bench_probe_start.py [--rounds 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INJECT_DIR = os.path.join(REPO, "kvdoctor", "delivery", "pythonpath")
ENGINE_IMPORT = "import sglang.srt.mem_cache.allocator.token"


def timed(code: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    bare = dict(os.environ)
    probed = dict(
        os.environ, PYTHONPATH=INJECT_DIR, KVDOCTOR_PACKAGE_ROOT=REPO, KVDOCTOR_TRACE=os.path.join(tempfile.mkdtemp(), "start.kvtrace.json")
    )
    report = {}
    for label, code, rounds in (("no_engine", "pass", args.rounds), ("sglang_allocator_import", ENGINE_IMPORT, max(3, args.rounds // 5))):
        without, with_probe = [], []
        for _ in range(rounds):
            without.append(timed(code, bare))
            with_probe.append(timed(code, probed))
        report[label] = {
            "without_ms_min": round(min(without) * 1e3, 1),
            "with_ms_min": round(min(with_probe) * 1e3, 1),
            "without_ms_median": round(statistics.median(without) * 1e3, 1),
            "with_ms_median": round(statistics.median(with_probe) * 1e3, 1),
            "added_ms_median": round((statistics.median(with_probe) - statistics.median(without)) * 1e3, 1),
            "rounds": rounds,
        }
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
