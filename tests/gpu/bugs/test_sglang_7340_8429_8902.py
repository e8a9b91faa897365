"""sglang#7340, #8429, #8902 (a finished request's multimodal inputs kept by the running batch) with
the batch on the GPU: tests/support/mm_inputs_cases.py with `KVDOCTOR_MM_DEVICE=cuda` on SGLang 0.5.7
(keeps the pixel values) and 0.5.8 (clears them at finish), each in its own process, judged by
sglang_7340_8429_8902_mm_inputs.py: 0.5.7 named with both images' bytes on cuda:0, which only the
batch's list kept allocated; 0.5.8 silent; no synchronizing call from the multimodal inputs ledger,
and the probe's others only where the slot ledger reads the device."""

import os
import subprocess
import sys

import pytest

from .. import runs
from .sglang_7340_8429_8902_mm_inputs import judge

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("release,expect", [("0.5.7", "held"), ("0.5.8", "clears")])
def test_the_release_with_the_bug_is_named_and_the_fixed_one_is_silent(tmp_path, sglang_env, release, expect):
    env = {**sglang_env(release), "KVDOCTOR_MM_DEVICE": "cuda", "KVDOCTOR_MM_HELD_AGE_S": "3600"}
    trace = tmp_path / f"mm_inputs_{release}.trace.json"
    command = [sys.executable, os.path.join(runs.SUPPORT, "mm_inputs_cases.py"), str(trace)]
    proc = subprocess.run(command, env=env, cwd=runs.REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / f"mm_inputs_{release}.result").write_text(proc.stdout)
    verdict = judge(str(tmp_path), release, expect)
    assert verdict["ok"], {k: verdict.get(k) for k in ("checks", "memory", "probe_syncs", "error")}
