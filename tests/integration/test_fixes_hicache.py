"""Optional fixes on the real SGLang classes, and HiCache's retained views (sglang#19332) on the
real 0.5.9 HostKVCache. Every fix is checked twice: the host's outcome is corrected, and the
finding it corrected is still reported (a fix never hides a finding)."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, sglang_env

CASES = r"""
import json, os, sys, tempfile, warnings
warnings.filterwarnings("ignore")
from kvdoctor.analysis.analyzer import analyze
from kvdoctor.probe.core import runtime
from kvdoctor.trace.reader import iter_events
from kvdoctor.demo.workload import WorkloadConfig, run_workload
out = []
for fault, ps, fixes in json.loads(sys.argv[1]):
    path = tempfile.mktemp(suffix=".json")
    runtime.activate(path, fixes=fixes)
    r = run_workload(WorkloadConfig(fault=fault, page_size=ps))
    runtime.deactivate()
    a = analyze(iter_events(path))
    out.append({"fault": fault, "fixes": fixes, "diff": r.sglang_check["diff"], "digest": r.outputs_digest,
                "findings": [[f.kind, f.count] for f in a.findings]})
print("RESULT " + json.dumps(out))
"""


def run(cases, version="0.5.23"):
    proc = subprocess.run(
        [sys.executable, "-c", CASES, json.dumps(cases)], capture_output=True, text=True, env=sglang_env(version), cwd=REPO, timeout=600
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][7:])


def kinds(result):
    return {k: c for k, c in result["findings"]}


@pytest.fixture(scope="module")
def fixed():
    cases = [
        ["double-free", 1, []],
        ["double-free", 1, ["dedup-free"]],
        ["index-out-of-range", 4, []],
        ["index-out-of-range", 4, ["clamp-last-loc"]],
        ["relocate", 4, []],
        ["relocate", 4, ["recompute-last-loc"]],
        ["none", 4, ["dedup-free", "clamp-last-loc", "recompute-last-loc", "clone-host-indices"]],
    ]
    return run(cases)


def test_dedup_free(fixed):
    without, with_fix = fixed[0], fixed[1]
    assert without["diff"] != 0 and "double_alloc" in kinds(without)
    assert with_fix["diff"] == 0  # the free list holds no duplicate
    assert kinds(with_fix)["double_free"] == 64  # still reported
    assert kinds(with_fix)["fix_applied"] == 64
    assert "double_alloc" not in kinds(with_fix)  # the cascade is gone


def test_clamp_last_loc(fixed):
    without, with_fix = fixed[2], fixed[3]
    assert "index_out_of_range" in kinds(without)
    assert kinds(with_fix)["index_out_of_range"] == 1
    assert kinds(with_fix)["fix_applied"] == 1
    assert with_fix["diff"] == 0


def test_recompute_last_loc(fixed):
    without, with_fix = fixed[4], fixed[5]
    assert kinds(without)["stale_last_loc"] > 1 and "use_after_free" in kinds(without)
    assert kinds(with_fix)["stale_last_loc"] == 1  # the relocation itself is still reported
    assert kinds(with_fix)["fix_applied"] == 1
    assert "use_after_free" not in kinds(with_fix)


def test_fixes_change_nothing_on_a_clean_run(fixed):
    clean = fixed[6]
    assert clean["findings"] == [] and clean["diff"] == 0


HOST = r"""
import sys, warnings
warnings.filterwarnings("ignore")
from kvdoctor.probe.core import runtime
from kvdoctor.probe.engines.sglang import hicache
hicache.LONG_LIVED_S = 0.0
probe = runtime.activate(sys.argv[1], fixes=sys.argv[2:])
import random, torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost
pool = MHATokenToKVPool(size=4096, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=64, layer_num=2,
                        device="cpu", enable_memory_saver=False)
host = MHATokenToKVPoolHost(pool, host_to_device_ratio=8.0, host_size=0, page_size=16, layout="layer_first",
                            pin_memory=False, device="cpu")
# What HiRadixCache does with backups: each node keeps its host indices for as long as it lives,
# while other allocations and frees keep rebuilding the host pool's free list.
# One scan is taken early, as the writer thread's first round can take it (just after the first
# host alloc, with two views under 1 MiB, once in about twenty runs): the trace's last word on the
# views must still be the count at exit, not this one.
nodes, rng = {}, random.Random(0)
for i in range(3000):
    if i == 2:
        hicache.state(probe).periodic(probe)
    h = host.alloc(64)
    if h is None:
        for v in rng.sample(list(nodes), 50):
            host.free(nodes.pop(v))
        h = host.alloc(64)
    nodes[i] = h
    if i % 3 == 0:
        host.free(host.alloc(16))
runtime.deactivate()
"""


@pytest.mark.parametrize("fix", [[], ["clone-host-indices"]], ids=["no-fix", "clone-host-indices"])
def test_retained_views_on_the_real_host_pool(tmp_path, fix):
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.trace.reader import iter_events

    trace = str(tmp_path / "host.json")
    proc = subprocess.run(
        [sys.executable, "-c", HOST, trace, *fix], capture_output=True, text=True, env=sglang_env("0.5.9"), cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = list(iter_events(trace))
    analysis = analyze(iter(events))
    found = {f.kind: f for f in analysis.findings}
    counters = [e for e in events if e.name == "hicache"]
    assert counters and counters[-1].args["host_allocs"] > 3000
    if not fix:
        finding = found["retained_view"]
        assert "19332" in finding.message and finding.evidence["retained_bytes"] > 8 * finding.evidence["own_bytes"]
    else:
        assert "retained_view" not in found
        assert found["fix_applied"].count > 3000


def test_fixes_command_lists_every_fix():
    proc = subprocess.run([sys.executable, "-m", "kvdoctor.cli", "fixes"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0
    for name in ("clone-host-indices", "dedup-free", "clamp-last-loc", "graph-guard", "recompute-last-loc"):
        assert name in proc.stdout


def test_unknown_fix_is_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "run", "--fix", "make-it-fast", "--", "true"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "make-it-fast" in proc.stderr
