"""The GPU ledger's healthy alloc and free launched from the C fast path (csrc/launch.c) hand the
CUDA driver exactly what the Python ledger path hands it for the same call, on SGLang 0.5.23's real
`TokenToKVPoolAllocator`; what the C path does not take goes to the Python path; a failure in it
turns the probe off and spares the host.

No GPU here: both paths' driver launches are recorded instead (tests/support/device_fast_path_cases.py
says what is stood in for). bench/gpu/kernels_check.py runs the same launches on a GPU against the
torch ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SUPPORT, sglang_env

hotpath = pytest.importorskip("kvdoctor.probe.hotpath")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not hotpath.active(), reason="the compiled hot path is not built here")

CASES = os.path.join(SUPPORT, "device_fast_path_cases.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    trace = str(tmp_path_factory.mktemp("device") / "trace.json")
    proc = subprocess.run([sys.executable, CASES, trace], cwd=REPO, env=sglang_env("0.5.23"), capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    out["by_name"] = {s["name"]: s for s in out["steps"]}
    return out


# each kernel's first call, then a later call of the same rule, index width and alignment
PAIRS = [
    ("alloc 8, first", "alloc 8", 8),
    ("alloc 8, first", "alloc 16", 16),
    ("free 8, first", "free 8", 8),
    ("free int32, first", "free int32", 8),
    ("free unaligned, first", "free unaligned", 3),
]


@pytest.mark.parametrize("first,later,n", PAIRS)
def test_a_kernels_first_call_takes_the_python_path_and_later_ones_launch_from_c(result, first, later, n):
    one, two = result["by_name"][first], result["by_name"][later]
    assert len(one["first"]) == 1 and not one["c"] and not one["python"], one
    assert len(two["c"]) == 1 and not two["python"] and not two["first"] and not two["triton"], two
    function, grid, _block, _shared, stream, values = two["c"][0]
    assert function == one["first"][0]["function"] and grid == 1 and stream == 0x5000
    assert values[1] == n
    pointers = result["pointers"]
    assert (values[2], values[3], values[8]) == (pointers["state"], pointers["owner"], pointers["alloc_site"])


@pytest.mark.parametrize("later", ["alloc 8", "free 8", "free int32", "free unaligned"])
def test_the_c_launch_is_the_python_paths_launch_for_the_same_call(result, later):
    step = result["by_name"][later]
    assert step["c"] and step["python_same_call"] == step["c"], step


def test_each_rule_width_and_alignment_takes_its_own_kernel(result):
    firsts = [result["by_name"][first]["first"][0]["function"] for first, _, _ in PAIRS]
    assert len(set(firsts)) == 4  # alloc; free int64; free int32; free int64 unaligned


def test_the_call_site_is_the_hosts_caller(result):
    for name, site in result["sites"].items():
        assert site.startswith("<lambda> (tests/support/device_fast_path_cases.py:"), (name, site)
    assert len(set(result["sites"].values())) == len(result["sites"])


def test_what_c_does_not_take_goes_to_the_python_path(result):
    steps = result["by_name"]
    assert not any(steps["free empty"][k] for k in ("first", "python", "c", "triton"))
    for name in ("alloc 600 (more than a block)", "free 600"):
        big = steps[name]
        assert not big["c"] and [f["grid"] for f in big["first"]] == [2, 2], big  # check, then write
    hooked = steps["alloc 8, a launch hook set"]
    assert not hooked["c"] and not hooked["python"] and len(hooked["triton"]) == 1, hooked
    c_launches = sum(len(s["c"]) for s in result["steps"] if not s["name"].startswith("free 8, failing"))
    assert result["device_launches"] == c_launches == 6


def test_a_failure_in_the_c_launch_turns_the_probe_off_and_spares_the_host(result):
    assert result["freed_by_the_host"] == 8
    assert result["probe_on_after_failure"] is False
    assert "fault injected into the free fast path" in result["off_reason"]
