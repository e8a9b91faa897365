"""The native path's three tensor readers (in place, DLPack, torch's getters) on the tensors a GPU
server hands the probe (harness/readers_check.py): CPU and pinned host index tensors read alike by
every reader, pinned ones in place; CUDA ones left by the in-place reader to DLPack."""

import pytest

from . import runs

pytestmark = pytest.mark.gpu


def test_readers_agree_on_host_pinned_and_cuda_tensors():
    proc = runs.run("harness/readers_check.py", env=runs.plain_env(), timeout=300)
    out = runs.result(proc)
    assert "error" not in out, out  # the native path is built (run.sh builds it)
    assert out["all_good"] and proc.returncode == 0, [t for t in out["tensors"] if not t["good"]]
    assert {t["kind"] for t in out["tensors"]} == {"cpu", "pinned", "cuda"}
