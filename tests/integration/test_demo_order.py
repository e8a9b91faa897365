"""Each `kvdoctor demo --fault F` prints the planted fault as its first error finding, and every
later error finding that follows from it names its cause ("caused by double_free x64 slots at _finish")."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

PLANTED = {
    "leak": "orphan_slots",
    "double-free": "double_free",
    "stale-last-loc": "stale_last_loc",
    "relocate": "stale_last_loc",
    "index-out-of-range": "index_out_of_range",
    "double-alloc": "double_alloc",
}


@pytest.mark.parametrize("fault", list(PLANTED))
def test_the_planted_fault_comes_first_and_its_consequences_name_it(fault, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "demo", "--fault", fault, "--trace", str(tmp_path / "t.kvtrace.json")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR ")]
    assert errors and errors[0].startswith(f"ERROR {PLANTED[fault]} x"), proc.stdout
    first = errors[0].split(":")[0].removeprefix("ERROR ")
    for line in errors[1:]:
        assert f"caused by {first}" in line, line
