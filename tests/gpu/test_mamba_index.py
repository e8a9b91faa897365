"""vLLM's Mamba state column check (vllm#55600's hook) reading a CUDA tensor still being filled on
its stream (harness/mamba_index_check.py; vLLM's own model state runs on CPU in
tests/integration/test_vllm_mamba_index.py): no synchronizing call, nothing judged while the value
is in flight, then the bad column named on cuda:0 and the good one silent."""

import pytest

from . import runs

pytestmark = pytest.mark.gpu


def test_the_column_is_judged_once_the_stream_is_done_without_a_sync():
    proc = runs.run("harness/mamba_index_check.py", env=runs.plain_env(), timeout=300)
    out = runs.result(proc)
    assert out["pending_right_after"] == 2 and out["violations_right_after"] == 0, out
    assert out["pending_after"] == 0 and out["judged"] == 2, out
    assert out["named"] == [["bad-0", 7, [0, 1], "cuda:0"]], out
    assert out["ledger_on"] and out["ok"] and proc.returncode == 0, out
