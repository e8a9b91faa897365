"""What the in-run comparisons share: each arm runs in a fresh interpreter and prints one
`ARM <json>` line; arms alternate within one run so ratios never compare different runs."""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any


def run_arm(cmd: list[str], env: dict[str, str] | None = None) -> Any:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("ARM ")][-1][4:])


def write_report(report: dict, out: str | None) -> None:
    """A bench's result: printed, and written to `out` where given."""
    print(json.dumps(report, indent=2))
    if out:
        with open(out, "w") as fh:
            json.dump(report, fh, indent=2)


def rounds_parser(rounds: int = 3, repeats: int = 5) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=rounds, help="alternations of the arms")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed loops per arm")
    parser.add_argument("--out", help="also write the JSON result here")
    return parser
