"""The PD metadata row ledger on SGLang's own `ReqToMetadataIdxAllocator`, driven through the prefill's
`PrefillBootstrapQueue.ensure_metadata_buffer` and `maybe_release_metadata_buffer`
(`tests/support/metadata_pool_cases.py` says what is SGLang's): a clean run, a row never given back, a
row freed twice, and a row freed behind the probe's back. One process, one trace per case.
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

CASES = ("clean", "leak", "double_free", "behind")
RELEASE = "0.5.23"


@functools.cache
def _run(folder: str) -> tuple[dict, dict]:
    traces = {case: os.path.join(folder, f"metadata-{case}.kvtrace.json") for case in CASES}
    env = sglang_env(RELEASE)
    result = run_for_result(
        [sys.executable, os.path.join(SUPPORT, "metadata_pool_cases.py"), *traces.values()], env=env, cwd=REPO, timeout=300
    )
    return {case: list(iter_events(path)) for case, path in traces.items()}, result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _run(str(tmp_path_factory.mktemp("metadata")))


def _censuses(events: list) -> list:
    return [e.args for e in events if e.name == schema.METADATA_POOL]


def _exit_census(events: list) -> dict:
    """The exit census (an idle one may come before it where the workload paused past a writer round)."""
    (census,) = [c for c in _censuses(events) if c["when"] == "exit"]
    return census


def _findings(events: list, severities=("error", "warning")) -> list:
    return [f for f in analyze(iter(events)).findings if f.severity in severities]


def test_rows_taken_and_given_back_as_the_prefill_does_balance_and_name_nothing(runs):
    events, result = runs
    assert result["version"] == RELEASE and result["map"] == "sglang-0.5.23.toml"
    assert result["clean"] == {"free": list(range(8)), "listed": 8}
    assert _findings(events["clean"]) == [], [f.message for f in _findings(events["clean"])]
    census = _exit_census(events["clean"])
    assert census["judged"] is True
    assert {k: census[k] for k in ("rows", "free", "held", "leaked")} == {"rows": 8, "free": 8, "held": 0, "leaked": 0}


def test_a_row_never_given_back_is_named_with_its_request_and_the_alloc_site(runs):
    events, result = runs
    leaked = result["leak"]["leaked"]
    (finding,) = _findings(events["leak"])
    assert finding.kind == schema.METADATA_ROWS_LEAKED and finding.severity == "error" and finding.count == 1
    assert finding.evidence["slot_ids"] == [leaked] and finding.evidence["requests"] == {"leak-2": 1}
    assert finding.evidence["site"].startswith("ensure_metadata_buffer (sglang/srt/disaggregation/prefill.py:")
    assert "tests/support/metadata_pool_cases.py:" in finding.evidence["site"]
    assert f"index {leaked}, taken at ensure_metadata_buffer" in finding.message and "its request is gone" in finding.message
    census = _exit_census(events["leak"])
    assert census["judged"] is True and census["leaked"] == 1 and census["free"] == result["leak"]["free"] == 7


def test_a_row_freed_twice_is_named_at_the_second_free_and_one_past_the_pool_as_out_of_range(runs):
    events, result = runs
    index = result["double_free"]["index"]
    assert result["double_free"]["listed"].count(index) == 2 and 8 in result["double_free"]["listed"]  # SGLang's deque took both
    finding, outside = _findings(events["double_free"], ("error",))
    assert outside.kind == schema.METADATA_INDEX_OUT_OF_RANGE and outside.count == 1 and outside.evidence["slot_ids"] == [8]
    assert "outside ReqToMetadataIdxAllocator#0's 8 metadata buffer rows" in outside.message
    assert finding.kind == schema.METADATA_DOUBLE_FREE and finding.count == 1 and finding.evidence["slot_ids"] == [index]
    assert finding.evidence["site"].startswith("main (tests/support/metadata_pool_cases.py:")
    assert finding.evidence["first_free"].startswith("maybe_release_metadata_buffer (sglang/srt/disaggregation/prefill.py:")
    (census,) = _censuses(events["double_free"])
    assert census["judged"] is False and "1 index(es) listed twice" in census["not_judged"]


def test_a_row_freed_behind_the_ledgers_back_makes_the_census_say_it_cannot_judge(runs):
    events, result = runs
    assert result["behind"]["free"] == 7
    found = _findings(events["behind"])
    assert [f.kind for f in found] == [schema.PROBE_PARTIAL], [f.message for f in found]
    assert "not judged at the exit census" in found[0].message and "free in one and not the other (e.g. [0])" in found[0].message
    census = _exit_census(events["behind"])
    assert census["judged"] is False and census["leaked"] == 0
    assert not [e for e in events["behind"] if e.name == schema.VIOLATION]  # the dropped holder of row 1 is not named
