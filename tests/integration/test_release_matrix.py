"""The release matrix: every SGLang release CI can run (probes/releases.toml, status "tested"), its
real allocator, radix tree and request pool driven by the demo workload under the probe.

Per release: a clean run gives no error finding and SGLang's own check balances; a planted leak is
one `orphan_slots` finding with exactly the slots SGLang's check counts as `diff`; a planted double
free is one `double_free` finding with exactly the slots freed twice. The probe must have used the
map whose range covers the release, with every ledger on. Beside it, fast: every hook of that map
resolves in each release's own sources, its graph runner hooks included.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import RELEASES as RELEASE_FOLDERS
from conftest import REPO, SUPPORT, run_cases, run_for_result

from kvdoctor.probe.ledgers.requests import RID_NOT_PASSED
from kvdoctor.probe.maps.loader import map_for
from kvdoctor.probe.maps.versions import version_key

sys.path.insert(0, SUPPORT)
from engine_releases import installed, matrix_releases

CASES = [[1, "none"], [1, "leak"], [1, "double-free"]]
RELEASES = list(matrix_releases("sglang"))


def errors(result: dict) -> list[dict]:
    return [f for f in result["findings"] if f["severity"] == "error"]


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_release(release):
    results = {r["fault"]: r for r in run_cases(release, CASES)}
    expected_map = map_for("sglang", release)
    assert expected_map is not None, f"no map covers SGLang {release}"
    for result in results.values():
        assert result["version"] == release
        assert result["map"] == expected_map.source
        assert result["probe_on"] and result["ledgers_off"] == [], result["map_notes"]

    clean = results["none"]
    assert errors(clean) == [], clean["findings"]
    assert clean["sglang_check"]["diff"] == 0

    leak = results["leak"]
    planted = leak["planted"]["orphan_slots"]
    assert planted > 0 and leak["sglang_check"]["diff"] == planted
    assert [(f["kind"], f["count"]) for f in errors(leak)] == [("orphan_slots", planted)]
    assert len(errors(leak)[0]["evidence"]["slot_ids"]) > 0
    # the request: its rid where the pool is given the request (0.5.9 on), else the row and why no rid
    requests = str(errors(leak)[0]["evidence"]["requests"])
    assert ("conv" in requests) if version_key(release) >= version_key("0.5.9") else (RID_NOT_PASSED in requests), requests

    double = results["double-free"]
    at_plant = [f for f in errors(double) if f["kind"] == "double_free" and "_finish" in f["site"]]
    assert [f["count"] for f in at_plant] == [double["planted"]["double_free"]]


# Checks, in one process, each installed release's sources against the map of its range: a release's
# folder goes first on sys.path in turn (SGLang itself is never imported, only its files parsed).
RESOLVE = r"""
import importlib, json, sys
from kvdoctor.probe.maps.loader import map_for
from kvdoctor.probe.core.verify import check_map
GRAPH_ROLES = {"graph_replay", "graph_execute"}
base, out = list(sys.path), {}
for release, folder in json.loads(sys.argv[1]).items():
    sys.path[:] = ([folder] if folder else []) + base
    importlib.invalidate_caches()
    check = check_map(map_for("sglang", release))
    assert "sglang" not in sys.modules
    out[release] = {
        "map": check.probe_map.source,
        "unresolved": [f"{h.hook}: {h.problem}" for h in check.unresolved],
        "graph_hooks": [h.hook for h in check.hooks if h.role in GRAPH_ROLES],
    }
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def resolved() -> dict:
    folders = {r: ("" if r == "0.5.23" else os.path.join(RELEASE_FOLDERS, r)) for r in RELEASES if installed("sglang", r)}
    assert len(folders) == len(RELEASES), f"not installed: {sorted(set(RELEASES) - set(folders))} (run .ci/setup)"
    return run_for_result([sys.executable, "-c", RESOLVE, json.dumps(folders)], env=dict(os.environ), cwd=REPO, timeout=300)


@pytest.mark.parametrize("release", RELEASES)
def test_every_hook_of_its_map_resolves_in_the_release_graph_runners_included(resolved, release):
    """Every hook of the map of the release's range resolves in the release's own sources, and the
    map watches its graph replays: CudaGraphRunner.replay up to 0.5.13, the runners' execute (decode,
    prefill, the EAGLE draft and draft-extend runners) from 0.5.14 (issue #31)."""
    entry = resolved[release]
    assert entry["map"] == map_for("sglang", release).source
    assert entry["unresolved"] == [], entry["unresolved"]
    if version_key(release) < version_key("0.5.14"):
        assert entry["graph_hooks"] == ["CudaGraphRunner.replay"]
    else:
        assert {
            "DecodeCudaGraphRunner.execute",
            "PrefillCudaGraphRunner.execute",
            "EAGLEDraftCudaGraphRunner.execute",
            "EAGLEDraftExtendCudaGraphRunner.execute",
        } <= set(entry["graph_hooks"]), entry["graph_hooks"]


def test_every_listed_release_has_a_map_or_a_reason():
    from kvdoctor.probe.maps.releases import releases

    for entry in releases("sglang"):
        if entry.status == "not_run":
            assert entry.reason, entry
        elif entry.status == "same_as":
            assert entry.same_as in {r.version for r in releases("sglang")}
        else:
            assert entry.status == "tested" and map_for("sglang", entry.version) is not None, entry


def test_probes_command_in_an_environment_with_another_release():
    import subprocess

    from conftest import sglang_env

    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "probes"], env=sglang_env("0.5.18"), capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr
    assert "SGLang 0.5.18: map sglang-0.5.17.toml, 72/72 hooks resolve, tested in CI" in proc.stdout
    assert "    graph replays: watched (DecodeCudaGraphRunner.execute, PrefillCudaGraphRunner.execute," in proc.stdout
