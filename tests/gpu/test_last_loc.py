"""`last_loc` reaching SGLang 0.5.9's real Triton `alloc_extend` (page 16, a prefix of 20, so part 1
continues the prefix's page) and the JIT `store_cache` write (harness/last_loc.py). What each case
must show is what the 2026-11 H200 run showed (reports/gpu/SUMMARY.md, section 2): the probe names
it in the trace before the KV write is launched, and under compute-sanitizer's memcheck only the
unfixed out-of-range case writes out of bounds."""

import pytest

from . import runs

pytestmark = pytest.mark.gpu

# name: (arguments, the finding the probe must name, out_cache_loc slots past the pool)
CASES = {
    "oor-nofix": (["--case", "oor"], "index_out_of_range", 12),
    "oor-clamp-last-loc": (["--case", "oor", "--fix", "clamp-last-loc"], "index_out_of_range", 0),
    "oor-harness-clamp": (["--case", "oor", "--harness-clamp"], "stale_last_loc", 0),
    "stale-nofix": (["--case", "stale"], "stale_last_loc", 0),
    "stale-recompute-last-loc": (["--case", "stale", "--fix", "recompute-last-loc"], "stale_last_loc", 0),
}


@pytest.fixture(scope="module")
def warm(sglang_env, tmp_path_factory):
    """SGLang 0.5.9's environment, with Triton's and the JIT kernel's caches filled once (a run not
    judged), so that memcheck runs are not slowed by compiling under it."""
    env = sglang_env("0.5.9")
    trace = str(tmp_path_factory.mktemp("warm") / "warm.trace.json")
    runs.run("harness/last_loc.py", "--case", "oor", "--fix", "clamp-last-loc", "--trace", trace, env=env, timeout=300)
    return env


@pytest.mark.parametrize("name", CASES)
def test_the_probe_names_it_before_the_write(tmp_path, warm, name):
    args, kind, out_of_range = CASES[name]
    trace = str(tmp_path / f"{name}.trace.json")
    proc = runs.run("harness/last_loc.py", *args, "--trace", trace, env=warm, timeout=300)
    out = runs.result(proc)
    assert out["out_of_range_slots"] == out_of_range, out
    found = runs.findings(trace)
    assert kind in found, (kind, sorted(found))
    if name.startswith("stale"):  # part 1 goes to the page the row held when last_loc was read, or to its new one
        assert out["part1_pages"] == [out["new_page" if "recompute" in name else "old_page"]], out
    if name != "oor-nofix":
        assert out.get("completed") and proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name", CASES)
def test_only_the_unfixed_out_of_range_case_writes_out_of_bounds(tmp_path, warm, name):
    if not runs.compute_sanitizer():
        pytest.skip("compute-sanitizer is not on the PATH nor in /usr/local/cuda/bin")
    args, _, _ = CASES[name]
    proc = runs.run("harness/last_loc.py", *args, "--trace", str(tmp_path / "t.trace.json"), env=warm, timeout=300, memcheck=True)
    errors = runs.memcheck_errors(proc)
    if name == "oor-nofix":
        assert errors > 0 or "Invalid __global__ write" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    else:
        assert errors == 0, (proc.stdout + proc.stderr)[-3000:]
