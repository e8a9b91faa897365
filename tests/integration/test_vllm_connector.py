"""KV blocks a vLLM KV connector keeps after their request finished, on the real vLLM engine core
(.venv-vllm, the tiny model, in process) with the connectors of tests/support/kv_connectors.py,
which use vLLM's own `KVConnectorBase_V1` API: one that never reports its transfer done is named
with its requests, blocks, held-since and the deadline, apart from orphans; a correct delayed free
is clean; one that reports past the deadline is a warning; an abort while a remote KV load is
pending is reported as held. Each engine case is one run of about 15 s. Skipped when .venv-vllm
does not exist (.ci/setup-vllm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SUPPORT, TEST_MEMORY_CLASSES_BUDGET_MS, run_for_result

sys.path.insert(0, SUPPORT)

import vllm_server
from engine_releases import INSTALLED, folder, installed, matrix_releases

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(vllm_server.available()), reason=vllm_server.available() or "vLLM available")]

SHORT_DEADLINE_S = 1.0  # the cases step the engine until the probe has called the holds overdue


def clean_env() -> dict:
    """No KVDOCTOR_ setting of this run's, but the tests' budget for a memory-class reading: on a
    loaded machine one reading over the product's 2 ms turns that reading off, which is not these cases'."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_") and k != "PYTHONPATH"}
    env["KVDOCTOR_MEMORY_CLASSES_BUDGET_MS"] = TEST_MEMORY_CLASSES_BUDGET_MS
    return env


def run_case(case: str, tmp_path, deadline_s: float | None) -> tuple[dict, str, list[dict]]:
    """The case's RESULT line, its trace, and the trace's events (name and args)."""
    from kvdoctor.trace.reader import iter_events

    trace = str(tmp_path / f"{case}.kvtrace.json")
    env = clean_env()
    if deadline_s is not None:
        env["KVDOCTOR_CONNECTOR_DEADLINE_S"] = str(deadline_s)
    command = [vllm_server.VENV_PYTHON, os.path.join(SUPPORT, "vllm_connector_cases.py"), case, vllm_server.ensure_model(), trace]
    result = run_for_result(command, env=env, cwd=vllm_server.REPO, timeout=300)
    assert result["ledger_on"] and result["ledgers_off"] == [] and result["hooked_calls"] > 0, result
    return result, trace, [{"name": e.name, **e.args} for e in iter_events(trace)]


def replay(trace: str) -> tuple[int, dict]:
    """`kvdoctor replay TRACE --format json`, as a user runs it: its exit code and report."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "replay", trace, "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


def last_census(events: list[dict]) -> dict:
    return [e for e in events if e["name"] == "census"][-1]


def block_findings(report: dict) -> list[dict]:
    """The findings about KV blocks; the others (the probe's health, the memory of a short run)
    are not what these runs are about."""
    return [f for f in report["findings"] if f["kind"] in ("connector_held_blocks", "orphan_slots", "refcount_disagrees")]


def errors(report: dict) -> list[str]:
    return sorted(f["kind"] for f in report["findings"] if f["severity"] == "error")


def held_finding(report: dict) -> dict:
    found = block_findings(report)
    assert [f["kind"] for f in found] == ["connector_held_blocks"], report["findings"]  # and no orphan_slots
    return found[0]


def test_a_connector_that_never_frees_is_named_with_its_requests_blocks_and_deadline(tmp_path):
    result, trace, events = run_case("never_free", tmp_path, SHORT_DEADLINE_S)
    assert result["connector"] == "NeverFreeConnector" and result["generated"] == [4] * 4, result
    held = result["held"]  # vLLM's own scheduler: four finished requests, three blocks each, still allocated
    assert len(held) == 4 and all(len(ids) == 3 for ids in held.values()), result
    assert set(result["statuses"].values()) == {"FINISHED_LENGTH_CAPPED"}, result

    # the writer thread called each hold overdue once, and the exit said it again with its final age
    overdue = [e for e in events if e["name"] == "connector_overdue"]
    assert sorted((e["request"], e["still_held_at"]) for e in overdue) == sorted((r, at) for r in held for at in ("deadline", "exit"))

    code, report = replay(trace)
    assert code == 1 and errors(report) == ["connector_held_blocks"], report
    finding = held_finding(report)
    evidence = finding["evidence"]
    assert finding["severity"] == "error" and finding["count"] == 12, finding
    assert evidence["holder"] == "NeverFreeConnector" and evidence["reason"] == "connector_delayed_free", evidence
    assert evidence["deadline_s"] == SHORT_DEADLINE_S and evidence["still_held_requests"] == 4, evidence
    assert {r["request"]: sorted(r["block_ids"]) for r in evidence["holds"]} == held, evidence
    assert evidence["requests"] == {rid: 3 for rid in held}, evidence
    for request in evidence["holds"]:
        assert request["held_s"] >= SHORT_DEADLINE_S and request["held_since"].endswith("Z") and not request["released"], request
    oldest = evidence["holds"][0]
    assert "NeverFreeConnector" in finding["message"] and oldest["request"] in finding["message"], finding["message"]
    assert f"since {oldest['held_since']}" in finding["message"] and "1 s deadline" in finding["message"], finding["message"]

    # the census counts the same blocks apart: held for the connector, not orphaned
    census = last_census(events)
    assert census["reason"] == "exit" and census["orphan_blocks"] == 0, census
    assert census["connector_held_blocks"] == 12 and census["connector_held_requests"] == 4, census
    assert census["connector_oldest_hold"]["held_since"] == min(r["held_since"] for r in evidence["holds"]), census
    assert census["free_blocks"] == result["free_blocks"] == result["num_blocks"] - 1 - 12, census


def test_a_correct_delayed_free_gives_no_finding(tmp_path):
    result, trace, events = run_case("delayed_free", tmp_path, None)  # the default deadline
    assert result["connector"] == "DelayedFreeConnector" and result["held"] == {}, result
    assert 0 < result["idle_steps"] < 30, result  # the connector reported every request sent
    assert [e for e in events if e["name"].startswith("connector_")] == [], events
    code, report = replay(trace)
    assert code == 0 and errors(report) == [] and block_findings(report) == [], report["findings"]
    # every finished request's blocks were held for the connector, and came back
    census = last_census(events)
    assert census["connector_holds"] == 4 and census["connector_releases"] == 4, census
    assert census["connector_held_blocks"] == 0 and census["connector_held_requests"] == 0, census
    assert census["connector_deadline_s"] == 480.0 and census["connector_overdue"] == 0, census
    assert census["orphan_blocks"] == 0 and census["free_blocks"] == result["num_blocks"] - 1, census


def test_a_connector_that_frees_past_the_deadline_is_a_warning(tmp_path):
    result, trace, events = run_case("late_free", tmp_path, SHORT_DEADLINE_S)
    assert result["connector"] == "LateFreeConnector" and result["held"] == {}, result
    assert result["connector_stats"]["connector_overdue"] == result["connector_stats"]["connector_releases"] == 4, result
    late = [e for e in events if e["name"] == "connector_late_release"]
    assert len(late) == 4 and all(e["held_s"] >= SHORT_DEADLINE_S for e in late), late
    code, report = replay(trace)
    assert code == 0 and errors(report) == [], report  # a warning: the blocks came back
    finding = held_finding(report)
    assert finding["severity"] == "warning" and finding["count"] == 12 and "all released late" in finding["message"], finding
    census = last_census(events)
    assert census["orphan_blocks"] == 0 and census["connector_held_blocks"] == 0, census
    assert census["free_blocks"] == result["num_blocks"] - 1, census


def test_an_abort_while_waiting_for_remote_kv_is_held_for_the_connector(tmp_path):
    result, trace, events = run_case("never_receive", tmp_path, SHORT_DEADLINE_S)
    assert result["waiting_statuses"] == ["WAITING_FOR_REMOTE_KVS"], result
    held = result["held"]  # each prompt's two whole blocks, allocated for the load that never came
    assert len(held) == 4 and all(len(ids) == 2 for ids in held.values()), result
    assert set(result["statuses"].values()) == {"FINISHED_ABORTED"}, result

    code, report = replay(trace)
    assert code == 1 and errors(report) == ["connector_held_blocks"], report
    finding = held_finding(report)
    evidence = finding["evidence"]
    assert finding["severity"] == "error" and finding["count"] == 8, finding
    assert evidence["holder"] == "NeverReceiveConnector" and evidence["reason"] == "awaiting_remote_kv", evidence
    assert {r["request"]: sorted(r["block_ids"]) for r in evidence["holds"]} == held, evidence
    assert all(r["status"] == "FINISHED_ABORTED" for r in evidence["holds"]), evidence
    assert "finished_recving" in finding["message"], finding["message"]
    census = last_census(events)
    assert census["orphan_blocks"] == 0 and census["connector_held_blocks"] == 8, census


RENAMED_HOOK = """
import json, os, sys
from kvdoctor.probe.maps import loader as maps

real = maps.available_maps

def renamed(engine=None):
    out = real(engine)
    for probe_map in out:
        for spec in probe_map.classes:
            if spec.cls == "Scheduler" and "_connector_finished" in spec.methods:
                spec.methods["_connector_finished_renamed"] = spec.methods.pop("_connector_finished")
    return out

maps.available_maps = renamed
from kvdoctor.probe.core import runtime
from kvdoctor.probe.core.verify import check_map, describe_choice

check = check_map(maps.map_for("vllm", "0.32.0"))
probe = runtime.activate(sys.argv[1])
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.scheduler import Scheduler

pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
pool.free_blocks(pool.get_new_blocks(2))
out = {
    "check_off": sorted(check.ledgers_off()),
    "check_ledgers": check.ledgers(),
    "choice": describe_choice("vLLM 0.34.0", check),
    "scheduler_hooked": sorted(m for m, f in vars(Scheduler).items() if getattr(f, "__kvdoctor_role__", None)),
    "pool_hooked": bool(getattr(BlockPool.get_new_blocks, "__kvdoctor_role__", None)),
    "ledger_on": probe.ledger_on,
    "ledgers_off": sorted(probe.ledgers_off),
    "hooked_calls": probe.calls,
}
runtime.deactivate()
print("RESULT " + json.dumps(out))
"""


def test_a_release_without_a_hooked_method_keeps_the_connector_ledger_off(tmp_path):
    """A release no map was tested on (forced to 0.34.0) whose Scheduler lacks a method the map
    hooks: the probe checks the map against vLLM's installed sources, turns the connector ledger
    off with one probe_status line naming the method, hooks nothing of the Scheduler, and keeps the
    block ledger on."""
    from kvdoctor.trace.reader import iter_events

    trace = str(tmp_path / "renamed.kvtrace.json")
    env = {**clean_env(), "KVDOCTOR_VLLM_VERSION": "0.34.0"}
    result = run_for_result([vllm_server.VENV_PYTHON, "-c", RENAMED_HOOK, trace], env=env, cwd=vllm_server.REPO, timeout=120)
    assert result["check_off"] == ["connector"] and result["check_ledgers"] == ["blocks", "connector", "vllm_mamba_index"], result
    assert (
        "connector ledger off (Scheduler._connector_finished_renamed: Scheduler defines no _connector_finished_renamed)" in result["choice"]
    )
    assert result["ledger_on"] and result["ledgers_off"] == ["connector"] and result["hooked_calls"] > 0, result
    assert result["pool_hooked"] and result["scheduler_hooked"] == [], result

    statuses = [e.args for e in iter_events(trace) if e.name == "probe_status"]
    saying_why = [s for s in statuses if "_connector_finished_renamed" in str(s.get("reason"))]
    assert len(saying_why) == 1, statuses
    assert saying_why[0]["state"] == "partial" and saying_why[0]["ledgers_off"] == ["connector"], saying_why
    assert not any(s.get("state") == "off" for s in statuses), statuses
    assert not any(s.get("ledger") == "connector" for s in statuses), statuses  # the connector ledger never started


CHECK_CONNECTOR_HOOKS = """
import json, sys
from kvdoctor.probe.maps.loader import map_for
from kvdoctor.probe.core.verify import check_map

check = check_map(map_for("vllm", sys.argv[1]))
print("RESULT " + json.dumps({"connector_hooks": sorted(h.hook for h in check.hooks if h.ledger == "connector"), "off": check.ledgers_off()}))
"""


@pytest.mark.parametrize("release", list(matrix_releases("vllm")))
def test_every_vllm_release_of_the_matrix_has_the_connector_hooks(release):
    """The three Scheduler methods resolve, arguments included, in each release's own sources."""
    env = clean_env()
    if release != INSTALLED["vllm"]:
        assert installed("vllm", release), f"vLLM {release} is not installed: run .ci/setup-vllm"
        env["PYTHONPATH"] = folder("vllm", release)
    result = run_for_result([vllm_server.VENV_PYTHON, "-c", CHECK_CONNECTOR_HOOKS, release], env=env, cwd=vllm_server.REPO, timeout=120)
    assert result == {
        "connector_hooks": ["Scheduler._connector_finished", "Scheduler._free_blocks", "Scheduler._free_request"],
        "off": {},
    }, result
