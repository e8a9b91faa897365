"""Releases whose prefill rows no hook sees (SGLang 0.5.1 - 0.5.3.post1) are not judged on a GPU
server, and are judged on a CPU one, with the probe in a fresh process.

On those releases `ScheduleBatch.prepare_for_extend` (0.5.3.post1: `ScheduleBatch.write_cache_indices`)
writes a prefill batch's rows with the Triton kernel `write_req_to_token_pool_triton`, launched in
place, whenever `support_triton(attention backend)` holds (every backend but torch_native,
intel_amx and ascend: any ordinary GPU server), and calls the hooked `ReqToTokenPool.write` only
on its fallback branch (SGLang's CPU engine). On the kernel's branch every slot a live request took
at prefill would look allocated and never written: an orphan to the rolling census, a false error.

Each run uses the release's real `ReqToTokenPool`, `TokenToKVPoolAllocator` and `RadixCache`
(`kvdoctor.demo.engine`). Two parts are stood in, there being no GPU here. The request table is
built by the real pool on torch's `meta` device (`ReqToTokenPool(device="meta")`): a tensor on a
device other than the host's, as a GPU server's `cuda:0` table is, with shapes and no storage. And
the kernel is not launched (it needs a GPU driver): on its branch SGLang calls no pool method, so the
workload writes each row into the table directly, as the kernel would, past every hook. The CPU
case writes rows as the fallback branch does, through `ReqToTokenPool.write`. Three requests are
live while the rolling census runs (every 0.2 s; three censuses counted in the probe's own state,
not by time), four slots are dropped (never written to a row, never freed), and the process ends
while busy, as a server stopped under load: the rolling census is the verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, sglang_env

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.probe.engines.sglang import coverage
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

WORKLOAD = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
trace, table_device = sys.argv[1], sys.argv[2]
from kvdoctor.probe.core import runtime
probe = runtime.activate(trace)
from kvdoctor.demo.engine import Engine, Request
from kvdoctor.probe.engines.sglang.state import sglang_state
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

engine = Engine(pool_tokens=512, page_size=1)
if table_device != "cpu":
    engine.req_pool = engine.req_to_token_pool = ReqToTokenPool(
        size=64, max_context_len=4096, device=table_device, enable_memory_saver=False
    )
    engine.tree = engine.tree_cache = engine._make_tree("radix", 1)  # the tree names the engine's request pool

def prefill(req, slots):
    if table_device == "cpu":  # the fallback branch: the hooked pool method
        engine.req_pool.write((req.req_pool_idx, slice(0, len(slots))), slots.to(torch.int32))
    else:  # the kernel's branch: the row written in place, no pool method called
        engine.req_pool.req_to_token[req.req_pool_idx, : len(slots)] = slots.to(torch.int32)

warm = Request("warm-0")
engine.take_row(warm)
tokens = list(range(10, 26))
slots = engine.allocator.alloc(len(tokens))
prefill(warm, slots)
prefix = engine.insert(tokens, slots, 0)  # the tree's hooked calls name the engine's pools
if prefix:
    engine.allocator.free(slots[:prefix])
engine.release_row(warm)
live = []
for n in range(3):  # requests still decoding: their rows hold their slots
    req = Request(f"live-{n}")
    engine.take_row(req)
    prefill(req, engine.allocator.alloc(16))
    live.append(req)
dropped = [int(s) for s in engine.allocator.alloc(4)]
state = sglang_state(probe)
since, censuses = time.monotonic(), {}
deadline = since + 120
while time.monotonic() < deadline and len(censuses) < 3:
    for rolling in list(state.rolling.values()):
        census, taken = rolling.last, rolling.last_s
        if census is not None and taken > since and census["live_requests"] == 3:
            censuses[taken] = {k: census[k] for k in ("orphan_slots", "owned_slots")} | {"judged": census.get("judged", True)}
    time.sleep(0.05)
print("RESULT " + json.dumps({
    "dropped": dropped,
    "table": str(engine.req_pool.req_to_token.device),
    "live_censuses": list(censuses.values()),
    "map": probe.maps["sglang"].source,
}), flush=True)
probe.emitter.flush()
os._exit(0)  # killed while busy, as a server stopped under load
"""


def _run(tmp_path, release: str, table_device: str) -> tuple[list, dict, str]:
    trace = str(tmp_path / f"{release}-{table_device}.kvtrace.json")
    env = {**sglang_env(release), "KVDOCTOR_ROLLING_CENSUS_S": "0.2"}
    # sglang_env puts the release's folder in place of PYTHONPATH: the checkout under test goes first
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", WORKLOAD, trace, table_device], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return list(iter_events(trace)), json.loads(lines[-1][len("RESULT ") :]), proc.stderr


def _coverage(events: list) -> dict:
    lines = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "coverage"]
    assert lines, "no coverage line"
    return lines[-1]


RELEASES = [("0.5.2", "sglang-0.5.2.toml"), ("0.5.3", "sglang-0.5.3.toml")]


@pytest.mark.parametrize("release,source", RELEASES)
def test_a_request_table_on_a_device_is_not_judged_and_says_why(tmp_path, release, source):
    events, result, stderr = _run(tmp_path, release, "meta")
    assert result["map"] == source and result["table"] == "meta"
    coverage_line = _coverage(events)
    assert coverage_line["state"] == "partial", coverage_line
    reason = coverage_line["reason"]
    assert "prefill rows are written by a kernel this release launches in place (ScheduleBatch.prepare_for_extend" in reason, reason
    assert "write_req_to_token_pool_triton), which no hook sees, into a request table on meta" in reason, reason
    assert stderr.count("orphans not judged: prefill rows are written by a kernel") == 1, stderr[-2000:]
    # Taken while the three requests were live. What the ledger would have said: every slot they
    # took at prefill (3 x 16) and the 4 dropped look orphaned. Before, that was an error verdict.
    live = result["live_censuses"]
    assert len(live) == 3 and all(c["judged"] is False for c in live), live
    assert live[-1]["orphan_slots"] == 3 * 16 + 4, live
    analysis = analyze(iter(events))
    assert not [f for f in analysis.findings if f.severity == "error"], [f.message for f in analysis.findings][:3]
    partial = [f for f in analysis.findings if f.kind == schema.PROBE_PARTIAL]
    assert any("prefill rows are written by a kernel" in f.message for f in partial), [f.message for f in partial]


def test_the_same_release_with_a_host_table_is_judged_and_names_the_real_drop(tmp_path):
    """One release of the two (the judging is the same code for both; each run costs ~15 s here)."""
    events, result, stderr = _run(tmp_path, "0.5.3", "cpu")
    assert result["map"] == "sglang-0.5.3.toml" and result["table"] == "cpu"
    coverage_line = _coverage(events)
    assert coverage_line["state"] == "on" and "not judged" not in stderr, coverage_line
    live = result["live_censuses"]
    assert len(live) == 3 and all(c["judged"] for c in live), live
    # the live rows' slots are theirs: of the 3 x 16 + 4 allocated, only the dropped are orphans
    assert live[-1]["orphan_slots"] == 4 and live[-1]["owned_slots"] == 3 * 16 + 4, live
    (orphans,) = [f for f in analyze(iter(events)).findings if f.kind == schema.ORPHAN_SLOTS]
    assert orphans.severity == "error" and orphans.count == 4 and sorted(orphans.evidence["slot_ids"]) == sorted(result["dropped"])


def test_the_rule_reads_only_the_tables_device():
    """`prefill_rows_unseen` on the environment's own SGLang `ReqToTokenPool` (0.5.23), its
    `req_to_token` on the host, on `meta` (a device's), and taken away: only a host table is proven
    to take the hooked fallback; a map that names no unhooked writer judges every table."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=4, max_context_len=8, device="cpu", enable_memory_saver=False)
    where = "ScheduleBatch.prepare_for_extend: write_req_to_token_pool_triton"
    assert coverage.prefill_rows_unseen(pool, where) == ""
    assert coverage.prefill_rows_unseen(None, where) == ""  # the engine's request pool not seen yet: decided when it is
    device_pool = ReqToTokenPool(size=4, max_context_len=8, device="meta", enable_memory_saver=False)
    assert coverage.prefill_rows_unseen(device_pool, "") == ""
    assert coverage.prefill_rows_unseen(device_pool, where).endswith(
        f"launches in place ({where}), which no hook sees, into a request table on meta"
    )
    del pool.req_to_token
    assert "a request table whose device is not known" in coverage.prefill_rows_unseen(pool, where)
