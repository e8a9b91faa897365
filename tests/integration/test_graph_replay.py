"""Graph replays during a HiCache load on SGLang 0.5.23's own graph runners (issue #31).

The runners of 0.5.14 on replay through `execute(forward_batch, ...)`. Two checks on the CPU:

- Every graph runner hook of the 0.5.23 map, against the real method: its signature (from the
  installed class) is bound as SGLang calls it, by position and by keyword, and the role must read
  the batch from it (forward mode, size, request ids, slot count; all host-side, no value read
  from the device), or read nothing where the method takes no batch.
- `tests/gpu/harness/graph_runner_23.py --cpu`: SGLang's own `DecodeCudaGraphRunner.execute`, hooked by the
  probe as a server's is, replays through the real `FullCudaGraphBackend` while SGLang's own
  `HybridCacheController` has a load in flight. Only CUDA's streams and events are stood in (an
  event is in flight until synchronised), and the runner is built without its ModelRunner (the
  script's docstring says what is stood in). During the load the replay is named with its batch and
  the loaded node; with graph-guard the replay's stream is made to wait on the load's event; after
  the load nothing is found.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, sglang_env

from kvdoctor.probe.core.hooks import REGISTRY, Hook
from kvdoctor.probe.core.verify import check_signature
from kvdoctor.probe.maps.loader import map_for

GRAPH_HOOKS = [
    (spec, method, role)
    for spec in map_for("sglang", "0.5.23").classes
    for method, role in spec.methods.items()
    if role in ("graph_replay", "graph_execute")
]


def _batch():
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=2,
        input_ids=torch.zeros(8, dtype=torch.int64),
        req_pool_indices=torch.tensor([3, 5]),
        seq_lens=torch.tensor([40, 41]),
        out_cache_loc=torch.arange(100, 108),
        seq_lens_sum=81,
        rids=["chat-1", "chat-2"],
    )


@pytest.mark.parametrize("spec,method,role_name", GRAPH_HOOKS, ids=[f"{s.cls}.{m}" for s, m, _ in GRAPH_HOOKS])
def test_the_role_reads_the_batch_from_the_real_signature(spec, method, role_name):
    REGISTRY.load("sglang")
    role = REGISTRY.get(role_name)
    cls = getattr(importlib.import_module(spec.module), spec.cls)
    function = cls.__dict__[method]
    positions = role.positions(spec.args.get(method))
    assert check_signature(function, positions, method=True) == ""  # the check made as it is wrapped
    hook = Hook(role_name, method, role.ledger, spec, positions)
    signature = inspect.signature(function)
    batch = _batch()
    values = {}
    for name, parameter in list(signature.parameters.items())[1:]:
        if parameter.default is inspect.Parameter.empty and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            values[name] = batch if name == "forward_batch" else object()
    runner = object.__new__(cls)
    positional = [v for n, v in values.items() if signature.parameters[n].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword_only = {n: v for n, v in values.items() if signature.parameters[n].kind == inspect.Parameter.KEYWORD_ONLY}
    by_position = signature.bind(runner, *positional, **keyword_only)
    by_name = signature.bind(runner, **values)
    for bound in (by_position, by_name):
        evidence = role.batch_evidence(hook, tuple(bound.args[1:]), dict(bound.kwargs))
        if "forward_batch" in signature.parameters:
            assert role_name == "graph_execute"
            assert evidence == {"forward_mode": "TARGET_VERIFY", "batch_size": 2, "rids": ["chat-1", "chat-2"], "slots": 8}
        else:
            assert role_name == "graph_replay" and positions == {} and evidence == {}


def test_sglang_0_5_23_decode_runner_during_a_hicache_load(tmp_path):
    out = tmp_path / "graph23.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tests", "gpu", "harness", "graph_runner_23.py"),
            "--cpu",
            "--traces",
            str(tmp_path),
            "--out",
            str(out),
        ],
        env=sglang_env("0.5.23"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(result["verdict"].values()), result["verdict"]
    cases = result["cases"]
    for case in cases.values():
        assert case["execute_hooked_as"] == "graph_execute" and case["controller_load_hooked_as"] == "hicache_load"
        assert case["probe_failures"] == 0 and case["sync_error"] is None
    (named,) = [f for f in cases["during"]["findings"] if f["kind"] == "graph_replay_during_load"]
    evidence = {k: named["evidence"].get(k) for k in ("graph_runner", "forward_mode", "batch_size", "rids", "slots", "load_node_ids")}
    assert evidence == {
        "graph_runner": "DecodeCudaGraphRunner",
        "forward_mode": "DECODE",
        "batch_size": 1,
        "rids": ["req-0"],
        "slots": 1,
        "load_node_ids": [7],
    }
    assert "by DecodeCudaGraphRunner (first: a DECODE batch of 1: req-0) started while 1 HiCache" in named["message"]
    assert "(loading tree nodes 7)" in named["message"]
    assert cases["during"]["cpu_stream_waits"] == 0  # no guard: nothing waits
    assert cases["guarded"]["cpu_stream_waits"] == 1  # graph-guard: the replay's stream waits on the load's event
    assert cases["guarded"]["load_done_when_execute_returned"] is False  # and the host did not
    assert [f["kind"] for f in cases["after"]["findings"]] == []
