"""Priority preemption of a request that finished in the last result (sglang#17797, PR#18694).

A request that finishes in a forward result is released there (its slots into the radix tree,
its row back) but stays in the running batch until `update_running_batch` filters it. A
high-priority request coming in between makes `PrefillAdder.preempt_to_schedule` preempt the
running requests: up to 0.5.5 it picks the finished one too, and `release_req` releases it a
second time: the slot the tree took is freed, then freed again when the tree evicts it (the
allocator lists it twice) and the tree node's lock is dropped twice. 0.5.9 skips finished
requests. Each release runs `tests/support/preempt_cases.py` in a fresh process (its docstring
says what is SGLang's), both at once.
"""

from __future__ import annotations

import pytest
from conftest import error_findings, judges_every_slot_ledger, release_case_runs

from kvdoctor.trace import schema

BUGGY, FIXED = "0.5.5", "0.5.9"  # the last release that frees a finished request's slots again, and the fixed one
PREEMPT = "preempt (PrefillAdder.preempt_to_schedule)"
PROMPT = 8  # req-low-0's prompt tokens: the slots after them are its decoded ones, the tree's since it finished


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return release_case_runs("preempt_cases.py", str(tmp_path_factory.mktemp("preempt")), "preempt", {BUGGY: ["case"], FIXED: ["case"]})


def test_preempting_a_finished_request_names_the_double_free_with_the_preemption_and_the_request(runs):
    traces, result = runs[BUGGY]
    assert result["version"] == BUGGY and result["map"] == "sglang-0.5.3.post2.toml"
    case, events = result["case"], traces["case"]
    # what SGLang did: req-low-0 finished, was preempted with req-low-1, and its decoded slot is on
    # the allocator's free list twice; SGLang's own idle check is off by the lock dropped twice
    assert case["finished"] == ["req-low-0"] and case["preempted"] is True
    assert case["preempt_list"] == ["req-low-0", "req-low-1"]
    twice = case["slots"]["req-low-0"][PROMPT:]
    assert case["free_list_twice"] == twice and len(twice) == 1
    assert case["sglang_check_diff"] == -1
    assert judges_every_slot_ledger(events)
    errors = {f.kind: f for f in error_findings(events)}
    assert set(errors) == {schema.DOUBLE_FREE, schema.LOCK_UNDERFLOW}
    double = errors[schema.DOUBLE_FREE]
    assert double.count == 1 and double.evidence["slot_ids"] == twice
    assert double.evidence["path"] == PREEMPT and double.evidence["forward_ct"] == 2
    row = case["rows"]["req-low-0"]
    assert double.evidence["released_request"] == f"req_pool_idx {row} (rid req-low-0)"
    assert double.evidence["site"].endswith(")") and "< release_req (sglang/srt/managers/schedule_batch.py:" in double.evidence["site"]
    assert f"(slots {twice[0]})" in double.message
    assert f"inside {PREEMPT} at forward 2, after it gave back req_pool_idx {row} (rid req-low-0)" in double.message
    # the second release's unlock, through the preemption
    assert "< release_req (" in errors[schema.LOCK_UNDERFLOW].evidence["site"]
    assert "< preempt_to_schedule (sglang/srt/managers/schedule_policy.py:" in errors[schema.LOCK_UNDERFLOW].evidence["site"]


def test_the_release_that_skips_finished_requests_is_silent(runs):
    traces, result = runs[FIXED]
    assert result["version"] == FIXED and result["map"] == "sglang-0.5.9.toml"
    case, events = result["case"], traces["case"]
    # the same path, driven the same way: only the running request is preempted
    assert case["finished"] == ["req-low-0"] and case["preempted"] is True and case["preempt_list"] == ["req-low-1"]
    assert case["free_list_twice"] == [] and case["sglang_check_diff"] == 0 and case["held_by_no_one"] == []
    assert judges_every_slot_ledger(events) and error_findings(events) == []
