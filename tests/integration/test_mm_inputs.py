"""Multimodal inputs held by finished requests, on SGLang's own request, batch and result processing
(sglang#7340, #8429, #8902: VLM GPU memory grows until OOM).

Up to 0.5.7 nothing drops a finished request's pixel values: `prepare_for_extend` wrote them back
into the request's items, and a batch whose requests all finished keeps its `multimodal_inputs` list
(`filter_batch` returns early), so the scheduler's running batch holds them while the engine idles.
0.5.8 clears them at the end of `Scheduler.process_batch_result` (`_maybe_clear_mm_inputs`, PR#17324),
and 0.5.23 still does (`MultimodalInputs.release_features`). Each release runs
`tests/support/mm_inputs_cases.py` in a fresh process, the three at once (its docstring says what is
SGLang's and what is not: the forward, the image processor, the loop's order written out): two image
requests prefill, decode and finish, a text request follows, the engine idles; on 0.5.23 a session's
image request also finishes, whose media SGLang keeps for the next turn.
"""

from __future__ import annotations

import os

import pytest
from conftest import error_findings, release_case_runs, silent_on_the_case

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema

BUGGY, FIXED, LATEST = "0.5.7", "0.5.8", "0.5.23"  # the last release that keeps them, the first that clears them, the newest
IMAGES = ("img-0", "img-1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three releases' cases, in three processes at once (most of each is SGLang's import)."""
    cases = {release: ["case"] for release in (BUGGY, FIXED, LATEST)}
    # the writer's round counts no hold here, however slow the machine: the counts are the next
    # result's and the exit's
    saved = os.environ.get("KVDOCTOR_MM_HELD_AGE_S")
    os.environ["KVDOCTOR_MM_HELD_AGE_S"] = "3600"
    try:
        return release_case_runs("mm_inputs_cases.py", str(tmp_path_factory.mktemp("mm")), "mm", cases)
    finally:
        if saved is None:
            os.environ.pop("KVDOCTOR_MM_HELD_AGE_S")
        else:
            os.environ["KVDOCTOR_MM_HELD_AGE_S"] = saved


def _counts(events: list) -> list:
    return [e.args for e in events if e.name == schema.MM_INPUTS]


def _steps(result: dict) -> dict:
    return {s["step"]: s for s in result["case"]["steps"]}


def test_pixel_values_a_finished_request_keeps_are_named_with_the_request_bytes_and_device(runs):
    traces, result = runs[BUGGY]
    assert result["version"] == BUGGY and result["map"] == "sglang-0.5.3.post2.toml"
    case, steps = result["case"], _steps(result)
    size = case["feature_bytes"]
    assert size == 2 * 3 * 32 * 32 * 4 and not case["clears_at_finish"]
    # what SGLang did: both image requests finish in the decode step with their pixel values, and at idle
    # the running batch (no request left in it) still holds both, the only thing keeping them alive
    decode = steps["decode img-0, img-1"]
    assert decode["finished"] == list(IMAGES) and decode["req_features"] == {rid: size for rid in IMAGES}
    assert case["alive_at_idle"] == {rid: 1 for rid in IMAGES}
    assert case["running_batch"] == {"reqs": 0, "multimodal_inputs": [size, size]}
    events = traces["case"]
    counts = _counts(events)
    # counted at the next result (the text request's prefill) and at exit: both held, one result after their finish
    assert [c["when"] for c in counts] == ["result", "exit"]
    for count in counts:
        assert count["bytes"] == 2 * size and count["by_device"] == {"cpu": 2 * size}
        assert [(h["rid"], h["bytes"], h["device"], h["results_since_finish"], h["request_alive"]) for h in count["held"]] == [
            (rid, size, "cpu", 1, False) for rid in IMAGES
        ]
        assert count["finished_requests_read"] == 3 and count["finished_with_features"] == 2
    (finding,) = error_findings(events)
    assert finding.kind == schema.MM_FEATURES_HELD and finding.count == 2
    assert finding.evidence["requests"] == {rid: size for rid in IMAGES}
    assert finding.evidence["still_held_bytes"] == 2 * size and finding.evidence["devices"] == ["cpu"]
    assert (
        f"{2 * size} bytes of multimodal feature tensors (pixel values/audio features) on cpu kept by 2 finished request(s)"
        in finding.message
    )
    assert f"Request img-0 holds {size} bytes in 1 item(s) on cpu, 1 result(s)" in finding.message
    assert "still held at the last count (exit)" in finding.message and "also img-1" in finding.message
    assert "the request object is gone: something else keeps them, such as a batch's multimodal_inputs list" in finding.message
    assert "sglang#7340, #8429, #8902" in finding.message and "Scheduler._maybe_clear_mm_inputs" in finding.message


@pytest.mark.parametrize("release", [FIXED, LATEST])
def test_the_releases_that_clear_them_at_finish_are_silent(runs, release):
    traces, result = runs[release]
    assert result["version"] == release and result["map"] == {FIXED: "sglang-0.5.3.post2.toml", LATEST: "sglang-0.5.23.toml"}[release]
    case, steps = result["case"], _steps(result)
    size = case["feature_bytes"]
    assert case["clears_at_finish"]
    # the probe's reader finds the pixel values while the requests decode (0.5.23's items are msgspec
    # structs, read through their slots); SGLang drops them in the result that finishes them
    assert steps["prefill img-0, img-1"]["probe_reads"] == {rid: size for rid in IMAGES}
    decode = steps["decode img-0, img-1"]
    assert decode["finished"] == list(IMAGES) and decode["req_features"] == {rid: None for rid in IMAGES}
    assert case["alive_at_idle"] == {rid: 0 for rid in IMAGES}
    # 0.5.23: a session's request keeps its pixel values past its finish, on purpose, and is never read
    session = {LATEST: {"finished": ["sess-0"], "req_features": {"sess-0": size}}}.get(release)
    assert {k: v for k, v in steps.get("prefill sess-0", {}).items() if k in ("finished", "req_features")} == (session or {})
    events = traces["case"]
    (count,) = _counts(events)  # one word at exit: the ledger read every finished request, none held features
    assert count["when"] == "exit" and count["results_processed"] == 3 + bool(session) and count["finished_requests_read"] == 3
    assert count["finished_with_features"] == 0 and count["held"] == [] and count["bytes"] == 0
    findings = analyze(iter(events)).findings
    assert silent_on_the_case(findings) == [], [f.message for f in findings]
