"""The GPU ledger's healthy alloc and free launched from the native fast path (csrc/launch.c) hand the
CUDA driver exactly what the Python ledger path hands it for the same call, on SGLang 0.5.23's real
`TokenToKVPoolAllocator`; what the native path does not take goes to the Python path; a failure in it
turns the probe off and spares the host.

No GPU here: both paths' driver launches are recorded instead (tests/support/device_fast_path_cases.py
says what is stood in for). tests/gpu/harness/kernels_check.py runs the same launches on a GPU against the
torch ledger.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SUPPORT, sglang_env

from kvdoctor.probe.ledgers.launch import LEDGER_WARPS

native = pytest.importorskip("kvdoctor.probe.native")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not native.active(), reason="the native path is not built here")

CASES = os.path.join(SUPPORT, "device_fast_path_cases.py")


def run_cases(folder, *mode: str) -> dict:
    trace = str(folder / "trace.json")
    proc = subprocess.run(
        [sys.executable, CASES, trace, *mode], cwd=REPO, env=sglang_env("0.5.23"), capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = run_cases(tmp_path_factory.mktemp("device"))
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


def launched_from_c_after_its_first_call(result, first: str, later: str) -> dict:
    """The `first` call compiled its kernel on the Python path; the `later` one launched that kernel
    from C, once, on the current stream, and nothing else."""
    one, two = result["by_name"][first], result["by_name"][later]
    assert len(one["first"]) == 1 and not one["c"] and not one["python"], one
    assert len(two["c"]) == 1 and not two["python"] and not two["first"] and not two["triton"], two
    function, grid, block, _shared, stream, _values = two["c"][0]
    assert function == one["first"][0]["function"] and grid == 1 and stream == 0x5000
    assert block == 32 * LEDGER_WARPS  # the threads of the warps the kernel was compiled for
    return two


@pytest.mark.parametrize("first,later,n", PAIRS)
def test_a_kernels_first_call_takes_the_python_path_and_later_ones_launch_from_c(result, first, later, n):
    values = launched_from_c_after_its_first_call(result, first, later)["c"][0][5]
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
    # 6 allocs and frees, 4 more allocs, a 600-slot alloc and free again (2 launches each), 600 more
    # for a write (2), 4 request-table writes, 2 paged allocs (each one launch with its last_loc
    # check) and a last_loc check alone
    assert result["device_launches"] == c_launches == 23


def test_a_call_of_more_than_a_block_launches_its_check_then_its_write_from_c(result):
    steps = result["by_name"]
    for first, later in (("alloc 600 (more than a block)", "alloc 600 again"), ("free 600", "free 600 again")):
        compiled = [f["function"] for f in steps[first]["first"]]
        step = steps[later]
        assert [(c[0], c[1]) for c in step["c"]] == [(compiled[0], 2), (compiled[1], 2)], step  # two programs each
        assert not step["python"] and not step["first"] and step["python_same_call"] == step["c"], step
        check, write = step["c"][0][5], step["c"][1][5]
        assert check[0] == check[8] == write[0] and check[1] == write[1] == 600 and check[-1] == write[-1]


def test_a_failure_in_the_c_launch_turns_the_probe_off_and_spares_the_host(result):
    assert result["freed_by_the_host"] == 8
    assert result["probe_on_after_failure"] is False
    assert "fault injected into the free fast path" in result["off_reason"]


# request-table writes: the owner kernel's first call, then a later call of the same plan
WRITES = [
    ("write one row, first", "write one row", 8),
    ("write rows, first", "write rows", 4),
    ("write int32 rows, first", "write int32 rows", 4),
]


@pytest.mark.parametrize("first,later,n", WRITES)
def test_a_request_table_writes_owner_update_launches_from_c_after_its_first_call(result, first, later, n):
    two = launched_from_c_after_its_first_call(result, first, later)
    values = two["c"][0][5]
    assert values[1] == n and values[3] == result["pointers"]["owner"]
    assert two["python_same_call"] == two["c"], two


def test_one_row_is_passed_as_its_number_and_rows_as_their_tensor(result):
    steps = result["by_name"]
    one = steps["write one row"]["c"][0][5]
    assert one[4] == one[0] and one[5] == 1  # no rows' tensor: the slots in its place, and the row
    rows = steps["write rows"]["c"][0][5]
    assert rows[4] != rows[0] and rows[5] == 0
    narrow = steps["write int32 rows"]["c"][0][5]
    assert narrow[4] != rows[4] and narrow[0] == rows[0]
    # one row, int64 rows and int32 rows: three compiled kernels
    assert len(set(result["owner_first_handles"])) == 3


def test_a_large_write_launches_one_program_a_block_and_a_mismatched_one_none(result):
    big = result["by_name"]["write one row of 600 slots"]
    assert [c[1] for c in big["c"]] == [2] and big["python_same_call"] == big["c"], big
    other = result["by_name"]["write rows of another length"]
    assert not any(other[k] for k in ("first", "python", "c", "triton")), other


def test_a_failure_in_a_writes_c_path_turns_the_probe_off_and_spares_the_host(tmp_path):
    out = run_cases(tmp_path, "write-failure")
    assert out["c_launches"] == 1 and out["row_written"] is True
    assert out["probe_on_after_failure"] is False
    assert "fault injected into the" in out["off_reason"], out


def test_a_paged_allocs_last_loc_check_and_its_alloc_are_one_launch_from_c(result):
    steps = result["by_name"]
    first = steps["extend, first"]  # the ledger is made here: the Python role, its two kernels
    assert len(first["first"]) == 2 and not first["c"], first
    for name in ("decode with rows", "extend, last_loc given"):
        two = launched_from_c_after_its_first_call(result, f"{name}, first", name)  # the fused kernel's
        assert two["python_same_call"] == two["c"], two
    assert steps["decode with rows, first"]["first"][0]["function"] != steps["extend, last_loc given, first"]["first"][0]["function"]
    decode = steps["decode with rows"]["c"][0][5]
    given = steps["extend, last_loc given"]["c"][0][5]
    assert decode[2] != decode[0] and given[2] == given[0]  # the rows get_last_loc read, or none
    assert (decode[1], decode[4]) == (2, 2) and (given[1], given[4]) == (2, 5)  # last_loc's count, the slots'


def test_a_paged_alloc_with_no_room_still_has_its_last_loc_checked(result):
    step = result["by_name"]["extend, no room"]
    assert len(step["c"]) == 1 and step["c"][0][0] == result["by_name"]["extend, first"]["first"][0]["function"], step
    assert step["python_same_call"] == step["c"], step
