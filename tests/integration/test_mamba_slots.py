"""The Mamba slot ledger on SGLang's own prefill pick over its `HybridReqToTokenPool`, `MambaPool` and
`MambaRadixCache` (sglang#15840, PR#16067).

`match_prefix` copies the tree's cached state into a fresh slot for a request (copy-on-write) before
`PrefillAdder.add_one_req` refuses it (NO_TOKEN). Up to 0.5.9 the refused request goes back to the
waiting queue holding that slot: a holder (SGLang's own idle check calls it a leak), and an orphan
once `_abort_on_waiting_timeout` drops the request; 0.5.10's scheduler frees the slot at the refusal.
Each release runs `tests/support/mamba_slot_cases.py` in a fresh process (its docstring says what is
SGLang's): the waiting case, the dropped case and, in the 0.5.9 one, the pool on a device.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
from conftest import REPO, SUPPORT, run_for_result, sglang_env

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

BUGGY, FIXED = "0.5.9", "0.5.10"  # the last release that keeps the slot at the refusal, the first that frees it


@functools.cache
def _run(release: str, folder: str) -> tuple[dict, dict]:
    cases = ["waiting", "dropped"] + (["device"] if release == BUGGY else [])
    traces = {case: os.path.join(folder, f"mamba-{release}-{case}.kvtrace.json") for case in cases}
    env = sglang_env(release)
    # sglang_env puts the release's folder in place of PYTHONPATH: the checkout under test stays in front
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), env.get("PYTHONPATH", "")) if p)
    env["KVDOCTOR_MAMBA_CENSUS_PERIOD_S"] = "0"  # a census at every pick: the cases pick a few times in a row
    result = run_for_result(
        [sys.executable, os.path.join(SUPPORT, "mamba_slot_cases.py"), *traces.values()], env=env, cwd=REPO, timeout=300
    )
    return {case: list(iter_events(path)) for case, path in traces.items()}, result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mamba"))
    return lambda release: _run(release, folder)


def _censuses(events: list) -> list:
    return [e.args for e in events if e.name == schema.MAMBA_POOL]


def _loud(events: list) -> list:
    """Errors, and warnings but the coverage line's (the KV ledger not judging beside a Mamba tree)."""
    findings = analyze(iter(events)).findings
    return [f for f in findings if f.severity == "error" or (f.severity == "warning" and f.kind != schema.PROBE_PARTIAL)]


def test_the_kv_ledger_names_no_orphan_beside_a_mamba_tree_and_says_why(runs):
    """The tree's 16-token prefix is KV the KV slot ledger cannot see held (MambaRadixCache is not a
    hooked RadixCache): it was named as 16 orphans at exit before the Mamba hooks told it."""
    traces, _ = runs(BUGGY)
    for case in ("waiting", "dropped"):
        assert [f for f in analyze(iter(traces[case])).findings if f.kind == schema.ORPHAN_SLOTS] == [], case
        coverage = [e.args["reason"] for e in traces[case] if e.name == schema.PROBE_STATUS and e.args.get("component") == "coverage"]
        said = "judge orphans; not judged: TokenToKVPoolAllocator#0: its slots are also held by a MambaRadixCache"
        assert any(said in reason for reason in coverage), coverage


def test_a_refused_requests_copy_on_write_slot_orphaned_by_its_drop_is_named_with_the_request_and_the_refusal(runs):
    traces, result = runs(BUGGY)
    assert result["version"] == BUGGY and result["map"] == "sglang-0.5.9.toml"
    dropped = result["dropped"]
    slot = dropped["slot_after_refusal"]
    # what SGLang did: the refused request kept the copied slot in the queue, the timeout dropped it, nothing freed it
    assert slot == 2 and dropped["steps"][1] == {"step": "waiting timeout", "waiting": [], "told": ["req-dropped"]}
    assert slot not in dropped["free_at_end"]
    errors = _loud(traces["dropped"])
    assert [f.kind for f in errors] == [schema.MAMBA_ORPHAN_SLOTS]
    (finding,) = errors
    assert finding.count == 1 and finding.evidence["slot_ids"] == [slot] and finding.evidence["requests"] == {"req-dropped": 1}
    assert finding.evidence["path"] == (
        "MambaRadixCache.match_prefix (copy-on-write) kept through PrefillAdder.add_one_req -> NO_TOKEN (the request went back to the waiting queue)"
    )
    assert finding.evidence["site"].startswith("init_next_round_input (sglang/srt/managers/schedule_batch.py:")
    assert "sglang#15840" in finding.message and "last held by request req-dropped" in finding.message
    # the census before the drop counted the waiting holder; after it, one slot was unaccounted
    assert [(c["waiting_holders"], c["unaccounted"]) for c in _censuses(traces["dropped"])] == [(1, 0), (0, 1)]


def test_a_waiting_request_holding_its_copied_slot_is_counted_never_an_orphan(runs):
    traces, result = runs(BUGGY)
    waiting = result["waiting"]
    assert waiting["slot"] == 2 and all(s["waiting"] == [["req-waiting", 2]] for s in waiting["steps"])
    assert waiting["sglang_check_says_leak"] is True  # SGLang's own idle check calls this holder a leak
    assert _loud(traces["waiting"]) == []
    (census,) = _censuses(traces["waiting"])  # said once: the second pick changed nothing
    assert census == {"slots": 4, "free": 2, "tree": 1, "request_rows": 0, "waiting_holders": 1, "request_holders": 1, "unaccounted": 0}


def test_the_release_that_frees_the_slot_at_the_refusal_is_silent(runs):
    traces, result = runs(FIXED)
    assert result["version"] == FIXED and result["map"] == "sglang-0.5.9.toml"
    assert result["waiting"]["slot"] is None and result["dropped"]["slot_after_refusal"] is None
    assert result["dropped"]["free_at_end"] == [2, 3, 4]
    for case in ("waiting", "dropped"):
        assert _loud(traces[case]) == [], case
        assert [c["unaccounted"] for c in _censuses(traces[case])] == [0], case  # the ledger counted, and all was held


def test_a_pool_on_a_device_is_not_judged_and_says_so(runs):
    traces, result = runs(BUGGY)
    device = result["device"]
    assert device["slot"] == "meta" and device["ledgers_off"] == ["mamba"] and device["probe_on"]
    assert _censuses(traces["device"]) == [] and not [e for e in traces["device"] if e.name == schema.VIOLATION]
    (partial,) = [f for f in analyze(iter(traces["device"])).findings if f.kind == schema.PROBE_PARTIAL]
    assert "Mamba slots not judged: the Mamba pool's slot numbers live on meta; reading them would synchronise" in partial.message
