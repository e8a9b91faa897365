"""sglang#13483 on SGLang's real HiCache: a partly served L3 prefetch's unfilled tail queued for
release twice by the prefetch IO thread (`HiCacheController._page_transfer`, then
`prefetch_io_aux_func`), so the scheduler's drain frees those host slots twice (SGLang 0.5.5 to
0.5.5.post3; 0.5.6 queues them once, PR#13501). The host pool's books (host_slots.py) name it at
the second queuing, with both sites, and the drain's free is not counted again; on 0.5.6 they name
nothing. `tests/support/hicache_prefetch_cases.py` (its docstring says what is SGLang's) runs each
release in a fresh process and prints SGLang's own free list, the ground truth."""

from __future__ import annotations

import functools
import os
import sys

import pytest
from conftest import REPO, SUPPORT, run_for_result, sglang_env

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

BUGGY, FIXED = "0.5.5.post3", "0.5.6"


@functools.cache
def _run(release: str, folder: str) -> tuple[list, dict]:
    trace = os.path.join(folder, f"prefetch-{release}.kvtrace.json")
    env = sglang_env(release)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), env.get("PYTHONPATH", "")) if p)
    result = run_for_result([sys.executable, os.path.join(SUPPORT, "hicache_prefetch_cases.py"), trace], env=env, cwd=REPO, timeout=300)
    return list(iter_events(trace)), result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("prefetch"))
    return lambda release: _run(release, folder)


def _host_violations(events: list) -> list[dict]:
    return [e.args for e in events if e.name == schema.VIOLATION and "(host pool)" in str(e.args.get("allocator", ""))]


def _host_slots_off(events: list) -> list[dict]:
    return [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "host_slots"]


def test_the_release_that_queues_the_tail_twice_is_named_with_both_sites(runs):
    events, result = runs(BUGGY)
    assert result["version"] == BUGGY
    duplicates = result["host_free_duplicates"]
    assert 0 < result["completed_tokens"] < result["prefetch_tokens"] and duplicates > 0  # SGLang's free list lists them twice
    terminated = result["cases"]["terminated"]
    assert terminated["completed_tokens"] == 0 and terminated["host_free_duplicates"] == terminated["op_host_indices"] > 0
    assert result["cases"]["missing_before_query"]["host_free_duplicates"] == 0  # batch_exists trimmed the tail first
    assert _host_slots_off(events) == []
    # one violation per case that doubled its release, in the cases' order: tail_lost, terminated
    violations = _host_violations(events)
    assert [v["count"] for v in violations] == [duplicates, terminated["host_free_duplicates"]]
    for violation in violations:
        assert violation["kind"] == schema.DOUBLE_FREE and violation["why"] == "queued for release while already queued"
        assert "prefetch_io_aux_func" in violation["site"]
        assert list(violation["queued_for_release_at"]) and all("_page_transfer" in s for s in violation["queued_for_release_at"])
        assert all("prefetch_from_storage" in site for site in violation["allocated_at"])
    assert violations[0]["slot_ids"][:16] == result["duplicate_slots"]  # the script lists the first 16
    findings = [f for f in analyze(events).findings if f.kind == schema.DOUBLE_FREE]
    assert sum(f.count for f in findings) == duplicates + terminated["host_free_duplicates"]
    assert all("_page_transfer" in f.message and "prefetch_io_aux_func" in f.message for f in findings)


def test_the_release_that_queues_it_once_is_silent(runs):
    events, result = runs(FIXED)
    assert result["version"] == FIXED
    assert 0 < result["completed_tokens"] < result["prefetch_tokens"]
    assert [case["host_free_duplicates"] for case in result["cases"].values()] == [0, 0, 0]
    assert _host_slots_off(events) == [] and _host_violations(events) == []
    assert not [f for f in analyze(events).findings if f.kind in (schema.DOUBLE_FREE, schema.DOUBLE_ALLOC)]
