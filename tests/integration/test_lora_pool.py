"""The LoRA memory pool's ledger on SGLang's own `LoRAManager` and `LoRAMemoryPool` (sglang#21380).

Up to 0.5.15 `LoRAManager.unload_lora_adapter` forgets the adapter and leaves its uid in the pool's
buffer slot: a ghost uid. 0.5.16 frees the slot (`LoRAMemoryPool.remove_lora`, called by the unload).
Each release runs `tests/support/lora_pool_cases.py` in a fresh process (its docstring says what is
SGLang's and why the base model's layer is a `ReplicatedLinear`): two adapters loaded, used by a
batch and unloaded, a third loaded and used. One process per release; the not-understood case
rides in the 0.5.15 one.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
from conftest import REPO, SUPPORT, run_for_result, sglang_env, silent_on_the_case

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

BUGGY, FIXED = "0.5.15", "0.5.16"  # the last release with the bug, the first with the fix


@functools.cache
def _run(release: str, folder: str) -> tuple[list, list, dict]:
    traces = [os.path.join(folder, f"lora-{release}.kvtrace.json")]
    if release == BUGGY:
        traces.append(os.path.join(folder, f"lora-{release}-not-understood.kvtrace.json"))
    env = sglang_env(release)
    # sglang_env puts the release's folder in place of PYTHONPATH: the checkout under test stays in front
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), env.get("PYTHONPATH", "")) if p)
    result = run_for_result([sys.executable, os.path.join(SUPPORT, "lora_pool_cases.py"), *traces], env=env, cwd=REPO, timeout=300)
    return list(iter_events(traces[0])), [list(iter_events(t)) for t in traces[1:]], result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lora"))
    return lambda release: _run(release, folder)


def _counts(events: list) -> list:
    return [e.args for e in events if e.name == schema.LORA_POOL]


def test_an_unloaded_adapters_uid_left_in_its_pool_slot_is_named_with_the_adapter_and_the_unload(runs):
    events, _, result = runs(BUGGY)
    assert result["version"] == BUGGY and result["map"] == "sglang-0.5.14.toml" and not result["remove_lora"]
    uids = result["uids"]
    # what SGLang's own pool held after each unload: the adapter's uid, in the slot the batch gave it
    assert [s["slots"][1:] for s in result["steps"]] == [
        [uids["adapter-a"], "|EMPTY|"],
        [uids["adapter-a"], "|EMPTY|"],
        [uids["adapter-a"], uids["adapter-b"]],
        [uids["adapter-a"], uids["adapter-b"]],
        [uids["adapter-c"], uids["adapter-b"]],  # adapter-c's batch evicted adapter-a's ghost
    ]
    findings = analyze(iter(events)).findings
    errors = [f for f in findings if f.severity == "error"]
    assert {f.kind for f in errors} == {schema.LORA_GHOST_UID}
    named = {next(iter(f.evidence["adapters"])): f.evidence["slot_ids"] for f in errors}
    assert named == {f"adapter-a (uid {uids['adapter-a']})": [1], f"adapter-b (uid {uids['adapter-b']})": [2]}
    assert sum(f.count for f in errors) == 2
    for finding in errors:
        assert "unloaded by LoRAManager.unload_lora_adapter at unload (tests/support/lora_pool_cases.py:" in finding.message
        assert "sglang#21380" in finding.message
        # the pool's uids vs the adapters loaded at exit: adapter-c loaded, adapter-b's ghost still in slot 2
        assert "At the last count (exit) the pool's 3 slots held 2 adapter uid(s) for 1 loaded adapter(s): 1 ghost(s)" in finding.message
    exit_count = _counts(events)[-1]
    assert exit_count["when"] == "exit" and exit_count["ghosts"] == [{"slot": 2, "uid": uids["adapter-b"], "adapter": "adapter-b"}]
    assert result["ghosts_at_end"] == {"2": uids["adapter-b"]}


def test_the_release_that_frees_the_slot_at_unload_is_silent(runs):
    events, _, result = runs(FIXED)
    assert result["version"] == FIXED and result["map"] == "sglang-0.5.16.toml" and result["remove_lora"]
    assert [s["slots"][1] for s in result["steps"]] == [
        result["uids"]["adapter-a"],
        "|EMPTY|",
        result["uids"]["adapter-b"],
        "|EMPTY|",
        result["uids"]["adapter-c"],
    ]
    findings = analyze(iter(events)).findings
    assert silent_on_the_case(findings) == [], [f.message for f in findings]
    counts = _counts(events)
    assert [c["when"] for c in counts] == ["load", "unload", "load", "unload", "load", "exit"]  # the ledger read every step
    assert all(c["ghost_uids"] == 0 for c in counts)
    assert {k: counts[-1][k] for k in ("pool_uids", "loaded_adapters", "base_model_slots")} == {
        "pool_uids": 1,
        "loaded_adapters": 1,
        "base_model_slots": 1,
    }


def test_a_pool_laid_out_otherwise_turns_the_lora_ledger_off_and_says_so(runs):
    _, (events,), result = runs(BUGGY)
    assert result["not_understood"] == {"loaded": True, "ledgers_off": ["lora"], "probe_on": True}
    assert _counts(events) == [] and not [e for e in events if e.name == schema.VIOLATION]
    (partial,) = [f for f in analyze(iter(events)).findings if f.kind == schema.PROBE_PARTIAL]
    assert "the LoRA pool ledger is off: LoRAMemoryPool.buffer_id_to_uid is tuple" in partial.message
