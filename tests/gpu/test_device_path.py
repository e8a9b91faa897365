"""The ledger kept from the native fast path against the one the Python path keeps, entry for entry, over
the same seeded calls through SGLang 0.5.9's real allocators under sync-debug "error"
(harness/device_path_check.py): a token allocator with request-table writes, and a paged one's
prefills, decode steps with last_loc and frees, a stale last_loc planted."""

import pytest

from . import runs

pytestmark = pytest.mark.gpu


def test_the_c_path_and_the_python_path_keep_the_same_ledger(sglang_env):
    proc = runs.run("harness/device_path_check.py", env=sglang_env("0.5.9"), timeout=400)
    out = runs.result(proc)
    assert out["probe_on"], out["off_reason"]
    for shape in ("token", "paged"):
        part = out[shape]
        assert not any(part["mismatched_entries"].values()), (shape, part["mismatched_entries"])
        assert part["driver"]["error"] is None and part["c"]["error"] is None, (shape, part)
        assert part["driver"]["c_launches"] == 0 and part["c"]["c_launches"] > 0, (shape, part)  # each path the one asked for
        assert any(part["c"]["counters"]), (shape, part["c"])  # the planted faults were counted
    assert out["ok"] and proc.returncode == 0
