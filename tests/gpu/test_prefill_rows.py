"""A prefill batch's request rows as a GPU server writes them (#24): SGLang's own
`write_cache_indices` with the triton backend, so its Triton kernel writes the rows and no pool
method is called (harness/prefill_rows.py, tests/support/prefill_batches.py). At page sizes 1 and 16:
the device ledger's owners equal `req_to_token`, the censuses while requests are live count 0
orphans, no GPU->CPU sync in the role's work (on 0.5.23 in the whole writer call)."""

import pytest

from . import runs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("release", ["0.5.23", "0.5.9"])
def test_the_kernels_rows_are_owned_as_written_and_nothing_is_orphaned(tmp_path, sglang_env, release):
    proc = runs.run("harness/prefill_rows.py", "--trace-dir", str(tmp_path), env=sglang_env(release), timeout=600)
    out = runs.result(proc)
    assert not out["dry_run_cpu"] and len(out["cases"]) == 2, out
    for case in out["cases"]:
        assert case.get("sglang") == release, case
        assert case.get("kernel") == "write_req_to_token_pool_triton (SGLang's)" and case.get("ledger_kernels"), case
        assert not case.get("role_syncs") and not case.get("sglang_syncs"), case
    assert out["mismatches"] == 0 and out["orphans"] == 0, out
    assert out["ok"] and proc.returncode == 0, out["cases"]
