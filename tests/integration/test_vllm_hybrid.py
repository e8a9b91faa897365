"""vLLM's hybrid KV cache under the block ledger, on the releases that have the bug and the fix.

vllm#42571: with a sliding-window group and `SimpleCPUOffloadConnector` in its eager mode, a block
the window freed and the request took again is listed twice in one store; the connector touches it
twice and frees it twice when the store completes. vLLM 0.22's `BlockPool.free_blocks` queues such
a block once per listing when its count falls to 0 (its free queue then counts 32 free blocks of a
31-block pool); 0.28's (vllm#42656, which classifies each block as its count falls) queues it once.
Both run vLLM's own `Scheduler`, connector and `BlockPool` in process (tests/support/
vllm_hybrid_cases.py): 0.22.0 from .venv-vllm-0.22, 0.28.0 from .venv-vllm/releases/0.28.0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SUPPORT

sys.path.insert(0, SUPPORT)

import vllm_server
from engine_releases import folder, installed

from kvdoctor.analysis.replay import analyze_trace

PYTHON_022 = os.path.join(REPO, ".venv-vllm-0.22", "bin", "python")
CASES = os.path.join(SUPPORT, "vllm_hybrid_cases.py")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(vllm_server.available()), reason=vllm_server.available() or "vLLM available")]


def run_case(python: str, release_folder: str | None, tmp_path) -> tuple[dict, str]:
    trace = str(tmp_path / "hybrid.kvtrace.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([p for p in (release_folder, REPO) if p])
    proc = subprocess.run(
        [python, CASES, vllm_server.ensure_model(), trace], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["connector"] == "SimpleCPUOffloadConnector" and result["finished"] and result["ledger_on"], result
    return result, trace


@pytest.mark.skipif(not os.path.exists(PYTHON_022), reason=".venv-vllm-0.22 does not exist: run .ci/setup-vllm")
def test_vllm_022_swa_offload_double_free_in_free_blocks_is_named(tmp_path):
    result, trace = run_case(PYTHON_022, None, tmp_path)
    assert result["version"] == "0.22.0", result
    # vLLM's own store listed a block twice, and its free queue now counts one block more than the pool has
    (store,) = result["stores_listing_a_block_twice"]
    twice = sorted({b for b in store if store.count(b) > 1})
    assert result["free_queue_count"] == result["usable_blocks"] + 1, result
    analysis = analyze_trace(trace)
    errors = [f for f in analysis.findings if f.severity == "error"]
    assert [f.kind for f in errors] == ["double_free"], [f.message for f in analysis.findings]
    finding = errors[0]
    assert finding.evidence["block_ids"] == twice and finding.count == len(twice) * 16, finding.evidence
    assert "_process_store_completion (vllm/v1/simple_kv_offload/manager.py" in finding.evidence["site"], finding.evidence
    assert "queued twice" in finding.evidence["note"], finding.evidence


@pytest.mark.skipif(not installed("vllm", "0.28.0"), reason="vLLM 0.28.0 is not installed: run .ci/setup-vllm")
def test_vllm_028_same_path_frees_each_block_once_and_is_silent(tmp_path):
    result, trace = run_case(vllm_server.VENV_PYTHON, folder("vllm", "0.28.0"), tmp_path)
    assert result["version"] == "0.28.0", result
    assert result["stores_listing_a_block_twice"], result  # the same path: a block touched and freed twice
    assert result["free_queue_count"] == result["usable_blocks"], result
    analysis = analyze_trace(trace)
    assert [f.kind for f in analysis.findings if f.severity == "error"] == [], [f.message for f in analysis.findings]
