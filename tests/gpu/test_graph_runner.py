"""Issue #31: SGLang's own graph runner replays a CUDA graph while its own HiCache controller is still
loading a request's prefix back (harness/graph_runner_23.py, graph_runner_59.py; the docstrings say
what is stood in). During the load the replay is named with its batch and the loaded node; with
graph-guard it waits on the device with no host sync and reads the loaded rows; after, silent.
`--cpu` runs the same plumbing in CI (tests/integration/test_graph_replay.py)."""

import json

import pytest

from . import runs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "script,release",
    [("harness/graph_runner_23.py", "0.5.23"), ("harness/graph_runner_59.py", "0.5.9")],
    ids=["DecodeCudaGraphRunner-0.5.23", "CudaGraphRunner-0.5.9"],
)
def test_a_replay_during_a_load_is_named_guarded_and_silent_after(tmp_path, sglang_env, script, release):
    out = tmp_path / "graph_runner.json"
    proc = runs.run(script, "--traces", str(tmp_path), "--out", str(out), env=sglang_env(release), timeout=500)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["cpu_dry_run"]
    failed = [name for name, held in result["verdict"].items() if not held]
    assert not failed and proc.returncode == 0, (failed, {case: r["findings"] for case, r in result["cases"].items()})
