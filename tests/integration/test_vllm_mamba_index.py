"""vLLM's V2 model runner seeding a Mamba state column past the request's mamba blocks, on the
releases that have the bug and the fix.

vllm#55600: in "align" Mamba prefix caching, `MambaHybridModelState.add_request` seeds
`_mamba_state_idx_gpu[req_index]`, the source column the next step's
`preprocess_mamba_align_fused_kernel` reads the request's mamba block table at, as
(num_computed_tokens - 1) // cache_config.block_size in 0.28-0.31: the attention block size, so a
request resuming over 128 cached tokens with attention blocks of 16 and mamba blocks of 64 gets
column 7 where its computed tokens fill 2 mamba blocks (out of bounds before the kernel). 0.32
divides by mamba_block_size (PR#55601) and seeds column 1. Each release runs vLLM's own
`MambaHybridModelState` and `NewRequestData` in process (tests/support/vllm_mamba_index_cases.py),
both at once: 0.31.0 from .venv-vllm/releases, 0.32.0 installed. 0.28.0 (its own map) was run the
same way and named the same column; in CI its hook is checked in its sources, with every release's.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest
from conftest import REPO, SUPPORT, run_for_result

sys.path.insert(0, SUPPORT)

import vllm_server
from engine_releases import INSTALLED, folder, installed, matrix_releases

from kvdoctor.analysis.replay import analyze_trace
from kvdoctor.trace.reader import iter_events

CASES = os.path.join(SUPPORT, "vllm_mamba_index_cases.py")
RELEASES = ("0.31.0", "0.32.0")  # 0.28 to 0.30 share the bug: their hook is checked below

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(vllm_server.available()), reason=vllm_server.available() or "vLLM available")]


@functools.cache
def runs() -> dict[str, tuple[dict, str]]:
    """release -> (its RESULT, its trace): one interpreter per release, all started at once."""
    where = tempfile.mkdtemp(prefix="vllm-mamba-index-")
    model = vllm_server.ensure_model()
    started = {}
    for release in RELEASES:
        assert installed("vllm", release), f"vLLM {release} is not installed: run .ci/setup-vllm"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_") and k != "PYTHONPATH"}
        env["PYTHONPATH"] = os.pathsep.join([p for p in (None if release == INSTALLED["vllm"] else folder("vllm", release), REPO) if p])
        trace = os.path.join(where, f"{release}.kvtrace.json")
        proc = subprocess.Popen(
            [vllm_server.VENV_PYTHON, CASES, model, trace], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started[release] = (proc, trace)
    out = {}
    for release, (proc, trace) in started.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, stderr[-3000:]
        result = json.loads(lines[-1][len("RESULT ") :])
        assert result["version"] == release and result["align"] and result["hooked"], result
        assert result["ledger_on"] and result["ledgers_off"] == [] and result["hooked_calls"] == 2, result
        assert (result["block_size"], result["mamba_block_size"]) == (16, 64), result
        # the check ran: it said so once, with both block sizes, and nothing turned it off
        statuses = [e.args for e in iter_events(trace) if e.name == "probe_status" and e.args.get("ledger") == "vllm_mamba_index"]
        assert [s["state"] for s in statuses] == ["on"], statuses
        assert "mamba_block_size 64, block_size 16, cpu" in statuses[0]["reason"], statuses
        out[release] = (result, trace)
    return out


def test_a_column_seeded_by_the_attention_block_size_is_named_before_the_kernel():
    result, trace = runs()["0.31.0"]
    assert result["map"] == "vllm-0.32.0.toml", result
    # vLLM's own tensor: (128 - 1) // 16 for the resumed request, -1 (fresh) for the other
    assert result["seeded"] == {"resumed-0": 7, "fresh-1": -1}, result
    findings = analyze_trace(trace).findings
    errors = [f for f in findings if f.severity == "error"]
    assert [f.kind for f in errors] == ["index_out_of_range"], [f.message for f in findings]
    (finding,) = errors
    evidence = finding.evidence
    assert finding.count == 1 and evidence["request"] == "resumed-0" and evidence["req_index"] == 0, evidence
    assert evidence["mamba_state_column"] == 7 and evidence["valid_columns"] == [0, 1], evidence
    assert evidence["num_computed_tokens"] == 128 and evidence["mamba_blocks_computed"] == 2, evidence
    assert (evidence["block_size"], evidence["mamba_block_size"]) == (16, 64), evidence
    assert evidence["block_ids_per_group"] == [13, 4], evidence
    assert evidence["site"].startswith("main (tests/support/vllm_mamba_index_cases.py:"), evidence
    assert "seeded column 7 for request resumed-0" in finding.message and "vllm#55600" in finding.message, finding.message
    assert "out of range before the kernel" in finding.message and "PR#55601" in finding.message, finding.message


def test_the_fixed_release_seeds_a_column_inside_the_mamba_blocks_and_is_silent():
    result, trace = runs()["0.32.0"]
    assert result["map"] == "vllm-0.32.0.toml", result
    assert result["seeded"] == {"resumed-0": 1, "fresh-1": -1}, result  # (128 - 1) // 64: the same path, judged
    findings = analyze_trace(trace).findings
    assert [f.kind for f in findings if f.severity == "error"] == [], [f.message for f in findings]


CHECK_SEED_HOOK = """
import json, sys
from kvdoctor.probe.maps.loader import map_for
from kvdoctor.probe.core.verify import check_map

check = check_map(map_for("vllm", sys.argv[1]))
print("RESULT " + json.dumps({"hooks": sorted(h.hook for h in check.hooks if h.ledger == "vllm_mamba_index"), "off": check.ledgers_off()}))
"""


@pytest.mark.parametrize("release", list(matrix_releases("vllm")))
def test_every_vllm_release_of_the_matrix_has_the_seed_hook(release):
    """`MambaHybridModelState.add_request(req_index, new_req_data)` resolves, arguments included, in
    each release's own sources (0.28-0.31 with the bug, 0.32-0.33 with the fix)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = REPO if release == INSTALLED["vllm"] else os.pathsep.join([folder("vllm", release), REPO])
    result = run_for_result([vllm_server.VENV_PYTHON, "-c", CHECK_SEED_HOOK, release], env=env, cwd=REPO, timeout=120)
    assert result == {"hooks": ["MambaHybridModelState.add_request"], "off": {}}, result
