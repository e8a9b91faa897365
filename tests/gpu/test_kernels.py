"""The slot ledger's Triton kernels against its torch path, op for op over 20 seeded sequences, by
each launch path: Triton's own, compiled through Triton's launcher, and through the CUDA driver from
the native path (harness/kernels_check.py; it also times each, which bench/gpu/run_launch.sh
reports)."""

import pytest

from . import runs

pytestmark = pytest.mark.gpu


def test_every_launch_path_keeps_the_ledger_the_torch_path_keeps():
    env = {**runs.plain_env(), "KVDOCTOR_LEDGER_LAUNCH": "direct"}  # the driver launch on for every release
    proc = runs.run("harness/kernels_check.py", env=env, timeout=400)
    out = runs.result(proc)
    assert proc.returncode == 0 and out["seeds"] == 60, out
    for launch in ("triton", "compiled", "direct"):
        assert out[f"mismatches_{launch}"] == 0, (launch, out.get(f"first_mismatch_{launch}"))
    assert out["compiled_launches_compiled"] > 0 and out["driver_launches_direct"] > 0, out  # each path really taken
