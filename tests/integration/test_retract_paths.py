"""The retract path under overlap scheduling, on SGLang's own decode loop (sglang#11970, PR#11981).

With overlap scheduling the scheduler plans forward N+1, retracting requests when the KV pool runs
short, before it processes forward N's result, and forward N holds one slot per request in flight.
0.5.3.post2 and 0.5.3.post3 retract through `cache_finished_req`, which frees only the slots before
it, and their result processing skips retracted requests: that slot is never freed. 0.5.4 frees
it when it processes forward N's result. Each release runs `tests/support/retract_cases.py` in a
fresh process (its docstring says what is SGLang's), both at once: the overlapped loop, and on the
buggy release also the plain loop, where nothing is in flight at a retract.
"""

from __future__ import annotations

import pytest
from conftest import error_findings, judges_every_slot_ledger, release_case_runs

from kvdoctor.trace import schema

BUGGY, FIXED = "0.5.3.post3", "0.5.4"  # the last release whose retract never frees the in-flight slot, the first that does
RETRACT = "retract (ScheduleBatch.retract_decode)"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both releases' cases, in two processes at once (most of each is SGLang's import)."""
    cases = {BUGGY: ["overlap", "plain"], FIXED: ["overlap"]}
    return release_case_runs("retract_cases.py", str(tmp_path_factory.mktemp("retract")), "retract", cases)


def _released(events: list) -> list:
    return [e.args for e in events if e.name == schema.VIOLATION and e.args.get("kind") == schema.ORPHAN_SLOTS]


def test_the_in_flight_slot_a_retract_never_frees_is_named_with_the_retract_path_its_step_and_the_request(runs):
    traces, result = runs[BUGGY]
    assert result["version"] == BUGGY and result["map"] == "sglang-0.5.3.post2.toml"
    overlap = result["overlap"]
    retracts = overlap["retracts"]
    # what SGLang did: two retracts, each leaving the slot of the forward in flight to no one, as its own check counts
    assert [r["rid"] for r in retracts] == ["req-2", "req-1"] and overlap["waiting"] == ["req-2", "req-1"]
    assert overlap["sglang_check_diff"] == 2 and overlap["held_by_no_one"] == sorted(r["newest_slot"] for r in retracts)
    assert judges_every_slot_ledger(traces["overlap"])
    (finding,) = error_findings(traces["overlap"])
    assert finding.kind == schema.ORPHAN_SLOTS and finding.count == 2
    assert finding.evidence["slot_ids"] == overlap["held_by_no_one"]
    steps = {f"{RETRACT} at forward {r['forward_ct']}": 1 for r in retracts}
    assert finding.evidence["released_on"] == steps
    assert set(finding.evidence["requests"]) == {f"req_pool_idx {r['row']} (rid {r['rid']})" for r in retracts}
    assert f"given back with the request's row by {RETRACT} at forward {retracts[0]['forward_ct']} (1 slot(s))" in finding.message
    assert "This is SGLang's 'memory leak detected ... diff=2', with names" in finding.message
    # each named when the forward in flight at its retract was processed, with that retract's step and slot
    released = _released(traces["overlap"])
    assert [
        (v["path"], v["forward_ct"], v["slot_ids"], v["request"].endswith(f"(rid {r['rid']})"))
        for v, r in zip(released, retracts, strict=True)
    ] == [(RETRACT, r["forward_ct"], [r["newest_slot"]], True) for r in retracts]
    assert all(v["in_flight"].startswith("not freed once the next forward result was processed") for v in released)


def test_the_same_release_retracting_with_nothing_in_flight_is_silent(runs):
    """The plain loop processes each result before it plans the next forward: a retract frees all."""
    traces, result = runs[BUGGY]
    plain = result["plain"]
    assert [r["rid"] for r in plain["retracts"]] == ["req-2"]
    assert plain["sglang_check_diff"] == 0 and plain["held_by_no_one"] == []
    assert judges_every_slot_ledger(traces["plain"]) and error_findings(traces["plain"]) == [] and _released(traces["plain"]) == []


def test_the_release_that_frees_the_in_flight_slot_is_silent_and_names_no_finish_either(runs):
    """The finishing requests give back their rows with the slot in flight too, freed a forward
    later; before the release paths were hooked the probe named each of them at its release."""
    traces, result = runs[FIXED]
    assert result["version"] == FIXED and result["map"] == "sglang-0.5.3.post2.toml"
    overlap = result["overlap"]
    assert [r["rid"] for r in overlap["retracts"]] == ["req-2", "req-1"]  # the same path, driven the same way
    assert overlap["sglang_check_diff"] == 0 and overlap["held_by_no_one"] == []
    assert judges_every_slot_ledger(traces["overlap"])
    assert error_findings(traces["overlap"]) == [] and _released(traces["overlap"]) == []
