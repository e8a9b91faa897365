"""A ledger judges only what it proves it sees, on SGLang 0.5.23's real allocator, radix tree and
request pool, with the probe in a fresh process.

A request pool whose row writer is its own (a subclass overriding `write`) leaves every slot of a
live request looking orphaned. The probe must say so (a `coverage` probe_status, partial, with the
reason) and name no orphan; with the real, hooked pool the same workload is judged and a real drop
is named, so the check is not a blanket silence. The process ends while its requests are live (a
server stopped under load), so the rolling census is the verdict. Speculative decoding's row
writer (a kernel, not `write`) has its own tests: test_spec_decode.py.
"""

from __future__ import annotations

import os
import sys

from conftest import REPO, run_for_result

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

WORKLOAD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from kvdoctor.probe.core import runtime
probe = runtime.activate(sys.argv[1])
from kvdoctor.demo.engine import Engine, Request
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

class OwnRowWriterPool(ReqToTokenPool):
    def write(self, indices, values):  # rows filled without passing through a hooked call
        self.req_to_token[indices] = values

engine = Engine(pool_tokens=512, page_size=1)
if sys.argv[2] == "own-writer":
    engine.req_pool = OwnRowWriterPool(size=64, max_context_len=4096, device="cpu", enable_memory_saver=False)
    engine.tree = engine._make_tree("radix", 1)  # the tree names the engine's request pool

def finish(rid, tokens):
    req = Request(rid)
    engine.take_row(req)
    slots = engine.allocator.alloc(len(tokens))
    engine.req_pool.write((req.req_pool_idx, slice(0, len(tokens))), slots.to(torch.int32))
    prefix = engine.insert(tokens, slots, 0)
    if prefix:
        engine.allocator.free(slots[:prefix])
    engine.release_row(req)

finish("warm-0", list(range(10, 26)))
live = []
for n in range(3):  # requests still decoding: their rows hold their slots
    req = Request(f"live-{n}")
    engine.take_row(req)
    slots = engine.allocator.alloc(16)
    engine.req_pool.write((req.req_pool_idx, slice(0, 16)), slots.to(torch.int32))
    live.append(req)
dropped = [int(s) for s in engine.allocator.alloc(4)]  # a real drop: never written to any row, never freed
time.sleep(1.5)  # rolling censuses every 0.3 s
print("RESULT " + json.dumps({"dropped": dropped}), flush=True)
probe.emitter.flush()
import os
os._exit(0)  # killed while busy, as a server stopped under load: the rolling census is the verdict
"""


def _run(tmp_path, mode: str) -> tuple[list, dict]:
    trace = str(tmp_path / f"{mode}.kvtrace.json")
    env = {**os.environ, "KVDOCTOR_ROLLING_CENSUS_S": "0.3"}
    result = run_for_result([sys.executable, "-c", WORKLOAD, trace, mode], env=env, cwd=REPO, timeout=300)
    return list(iter_events(trace)), result


def test_a_request_pool_with_its_own_row_writer_is_said_and_not_judged(tmp_path):
    events, _ = _run(tmp_path, "own-writer")
    coverage = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "coverage"]
    assert coverage and coverage[-1]["state"] == "partial", coverage
    assert "OwnRowWriterPool.write" in coverage[-1]["reason"] and "not hooked" in coverage[-1]["reason"], coverage[-1]
    assert coverage[-1]["engine_pools"]["req_to_token_pool"] == "OwnRowWriterPool"
    censuses = [e.args for e in events if e.name == schema.CENSUS]
    assert censuses and all(c.get("judged") is False for c in censuses)
    # what the ledger would have said: every slot of the live requests looks orphaned
    assert censuses[-1]["reason"] == "rolling" and censuses[-1]["orphan_slots"] >= 3 * 16, censuses[-1]
    analysis = analyze(iter(events))
    assert not [f for f in analysis.findings if f.severity == "error"], [f.message for f in analysis.findings][:3]
    partial = [f for f in analysis.findings if f.kind == schema.PROBE_PARTIAL]
    assert any("OwnRowWriterPool" in f.message for f in partial)


def test_the_same_workload_on_the_hooked_pool_is_judged_and_names_the_real_drop(tmp_path):
    events, result = _run(tmp_path, "hooked")
    coverage = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "coverage"]
    assert coverage and coverage[-1]["state"] == "on", coverage
    analysis = analyze(iter(events))
    (orphans,) = [f for f in analysis.findings if f.kind == schema.ORPHAN_SLOTS]
    assert orphans.count == 4 and sorted(orphans.evidence["slot_ids"]) == sorted(result["dropped"])


HYBRID = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
from kvdoctor.probe.core import runtime
probe = runtime.activate(sys.argv[1])
from kvdoctor.demo.engine import Engine
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

engine = Engine(pool_tokens=512, page_size=1)
shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=4, head_dim=8, state_size=8, conv_kernel=4)
engine.req_pool = HybridReqToTokenPool(  # a hybrid linear-attention model's request pool: rows and Mamba state slots
    size=8, mamba_size=10, mamba_spec_state_size=10, max_context_len=64, device="cpu", enable_memory_saver=False,
    cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]), mamba_layer_ids=[0, 2], enable_mamba_extra_buffer=False,
    enable_overlap_schedule=False,
)
engine.tree = engine._make_tree("radix", 1)  # the tree names the engine's request pool
tokens = list(range(10, 26))
slots = engine.allocator.alloc(len(tokens))
engine.insert(tokens, slots, 0)  # the tree's hooked calls name the engine's pools
engine.allocator.free(engine.allocator.alloc(4))
runtime.deactivate()
print("RESULT " + json.dumps({"mamba": type(engine.req_pool.mamba_pool).__name__}), flush=True)
"""


def test_a_hybrid_request_pools_state_slots_are_said_by_standing(tmp_path):
    """SGLang 0.5.23's real `HybridReqToTokenPool` (a hybrid linear-attention model's: rows, and
    Mamba state slots in a `MambaPool` with its own `MambaSlotAllocator`): the Mamba slots are judged
    at the quiet censuses (mamba_slots.py; the real server's cases: tests/e2e/test_hybrid_server.py),
    and the coverage line says so by class and role; the other state pools it holds beside its rows
    (short-conv states, n-gram tables) are counted by no ledger, and the line says that too, partial."""
    trace = str(tmp_path / "hybrid.kvtrace.json")
    result = run_for_result([sys.executable, "-c", HYBRID, trace], env=dict(os.environ), cwd=REPO, timeout=300)
    assert result["mamba"] == "MambaPool"
    events = list(iter_events(trace))
    coverage = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "coverage"]
    assert coverage and coverage[-1]["state"] == "partial", coverage
    untracked = coverage[-1]["untracked_pools"]
    assert "req_to_token_pool.mamba_pool" not in untracked and "req_to_token_pool.mamba_allocator" not in untracked, untracked
    assert untracked.get("req_to_token_pool.short_conv_pool") == "ShortConvPool", untracked
    reason = coverage[-1]["reason"]
    assert "MambaSlotAllocator (req_to_token_pool.mamba_allocator): judged when the engine is quiet" in reason, reason
    assert "ShortConvPool (req_to_token_pool.short_conv_pool)" in reason and "neither tracked nor judged" in reason, reason
    analysis = analyze(iter(events))
    assert not [f for f in analysis.findings if f.severity == "error"], [f.message for f in analysis.findings][:3]
    assert any("ShortConvPool" in f.message for f in analysis.findings if f.kind == schema.PROBE_PARTIAL), [
        f.message for f in analysis.findings
    ]
