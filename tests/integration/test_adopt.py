"""A probe that arrives late (attach, or any activation after the engine started) adopts the state it
finds, on SGLang's real allocator, radix trees and request pool: what leaked before it arrived is
named exactly, what the tree or a live request holds is not."""

import pytest
import torch

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.demo.workload import Engine, Request, WorkloadConfig, run_workload
from kvdoctor.probe import runtime
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events


def _live_request(engine: Engine, tokens: int) -> torch.Tensor:
    """A request still decoding: its row and slots are in use."""
    req = Request("live-at-attach")
    (row,) = engine.req_pool.alloc([req])
    req.kv.req_pool_idx = row
    slots = engine.allocator.alloc(tokens)
    engine.req_pool.write((row, slice(0, tokens)), slots.to(torch.int32))
    req.kv.kv_allocated_len = tokens
    _live_request.keep = req  # the scheduler would hold it
    return slots


@pytest.mark.parametrize("fault,tree", [("leak", "radix"), ("none", "radix"), ("leak", "unified"), ("none", "unified")])
def test_a_late_probe_names_exactly_what_leaked_before_it(tmp_path, fault, tree):
    engine = Engine(pool_tokens=4096, page_size=1, tree=tree)
    result = run_workload(WorkloadConfig(fault=fault, tree=tree), engine=engine)  # no probe yet
    held = _live_request(engine, 24)
    assert engine.sglang_leak_check()["diff"] == result.planted.get("orphan_slots", 0) + int(held.numel())

    trace = tmp_path / "late.kvtrace.json"
    probe = runtime.activate(str(trace))
    try:
        assert probe is not None
        extra = engine.allocator.alloc(4)  # the first hooked call meets the allocator in use
        engine.allocator.free(extra)
    finally:
        runtime.deactivate()
    events = list(iter_events(str(trace)))
    adopted = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("adopted")]
    assert len(adopted) == 1 and adopted[0]["live_requests"] == 1 and adopted[0]["rows_read_whole"] == 0
    assert adopted[0]["held_by_no_one_slots"] == result.planted.get("orphan_slots", 0)

    analysis = analyze(iter(events))
    errors = [f for f in analysis.findings if f.severity == "error"]
    if fault == "none":
        assert errors == []
    else:
        (leak,) = errors
        assert leak.kind == schema.ORPHAN_SLOTS and leak.count == result.planted["orphan_slots"]
        assert list(leak.evidence["requests"]) == ["no request or tree node when kvdoctor attached (leaked before attach)"]
        assert "leaked before kvdoctor attached" in leak.message
        assert not set(leak.evidence["slot_ids"]) & {int(s) for s in held}
    census = [e.args for e in events if e.name == schema.CENSUS][-1]
    assert census["ledger_disagrees_slots"] == 0  # the adopted ledger agrees with SGLang's own free list
