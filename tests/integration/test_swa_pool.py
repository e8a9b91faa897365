"""The SWA pool's ledger on SGLang's own `SWATokenToKVPoolAllocator`, `UnifiedRadixCache` and requests
(sglang#36081, PR#36135).

SGLang 0.5.18's `free_swa` defers, inside a free group, both the free and the reading of
`full_to_swa_index_mapping` to the group's end. In one prefill result step a request that decodes on
frees the SWA side of its out-of-window tokens (deferred) and caches them as an SWA tombstone; a
request that finished with the same prompt then recovers that tombstone (`RecoverSWAWithLockedFull`),
re-pointing the first request's full slots at its own SWA slots, and the group's end frees those:
live SWA slots freed, the ones asked for held by nothing. 0.5.19 reads the mapping at the call.
Each release runs `tests/support/swa_pool_cases.py` in a fresh process (its docstring says what is
SGLang's); the two run side by side.
"""

from __future__ import annotations

import pytest
from conftest import release_case_runs

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema

BUGGY, FIXED = "0.5.18", "0.5.19"  # the release that reads the mapping at the group's end, the first that reads it at the call
RECOVERED = {
    "full": list(range(1, 12)),
    "swa": list(range(17, 28)),
}  # the tombstone of req-a's 11 out-of-window tokens, recovered with req-b's SWA slots


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("swa"))
    return release_case_runs(
        "swa_pool_cases.py",
        folder,
        "swa",
        {release: ["recovery", "apart"] + (["device"] if release == BUGGY else []) for release in (BUGGY, FIXED)},
    )


def _loud(events: list) -> list:
    """Errors, and warnings but the probe's own partial lines (a composite pool's KV ledgers not judged)."""
    findings = analyze(iter(events)).findings
    return [f for f in findings if f.severity == "error" or (f.severity == "warning" and f.kind != schema.PROBE_PARTIAL)]


def test_the_live_swa_slots_a_deferred_free_takes_after_a_tombstone_recovery_are_named(runs):
    traces, result = runs[BUGGY]
    assert result["version"] == BUGGY and result["map"] == "sglang-0.5.17.toml"
    recovery = result["recovery"]
    # what SGLang did: the recovered node holds req-b's SWA slots 17-27, all back in the free list;
    # req-a's SWA slots 1-11, which its free asked for, are allocated and mapped from no full slot
    assert recovery["rows"] == {"req-a": list(range(1, 17)), "req-b": list(range(17, 33))} and recovery["finished"] == ["req-b"]
    assert recovery["nodes"][0] == {**RECOVERED, "swa_free": RECOVERED["swa"]}
    assert recovery["first_swa_lost"] == list(range(1, 12))
    errors = _loud(traces["recovery"])
    assert [f.kind for f in errors] == [schema.SWA_SLOT_FREED_LIVE]
    (finding,) = errors
    evidence = finding.evidence
    assert finding.count == 11 and evidence["slot_ids"] == RECOVERED["swa"] and evidence["full_slot_ids"] == RECOVERED["full"]
    assert evidence["asked_slot_ids"] == list(range(1, 12)) and evidence["requests"] == {"req-b": 11}
    assert evidence["site"].startswith("free_swa_out_of_window_slots (sglang/srt/mem_cache/common.py:")
    assert evidence["remapped_at"].startswith("apply_component_action (sglang/srt/mem_cache/unified_cache/components/swa_component.py:")
    assert evidence["path"].startswith(
        "SWATokenToKVPoolAllocator.free_swa deferred in a free group, run by its end at free_group_end (sglang/srt/mem_cache/allocator/swa.py:"
    )
    assert "sglang#36081" in finding.message and "mapped from full slot 1, 2, 3" in finding.message


def test_deferred_frees_without_a_recovery_are_silent_on_the_same_release(runs):
    traces, result = runs[BUGGY]
    apart = result["apart"]
    # req-a's out-of-window SWA slots went back through the same deferred free, and nothing else did
    assert apart["swa_free"] == 64 - 32 + 11 and apart["first_swa_lost"] == []
    assert all(node["swa_free"] == [] for node in apart["nodes"])
    assert _loud(traces["apart"]) == []


def test_the_release_that_reads_the_mapping_at_the_call_is_silent(runs):
    traces, result = runs[FIXED]
    assert result["version"] == FIXED and result["map"] == "sglang-0.5.19.toml"
    recovery = result["recovery"]
    assert recovery["nodes"][0] == {**RECOVERED, "swa_free": []} and recovery["first_swa_lost"] == []
    for case in ("recovery", "apart"):
        assert _loud(traces[case]) == [], case


def test_a_mapping_on_a_device_is_not_judged_and_says_so(runs):
    traces, result = runs[BUGGY]
    device = result["device"]
    assert device["mapping_device"] == "meta" and device["ledgers_off"] == ["swa"] and device["probe_on"]
    assert not [e for e in traces["device"] if e.name == schema.VIOLATION]
    said = [f.message for f in analyze(iter(traces["device"])).findings if f.kind == schema.PROBE_PARTIAL]
    assert any("SWA slots not judged: the full-to-SWA mapping lives on meta; reading it would synchronise" in m for m in said), said
