"""A probe that arrives while SGLang's real allocator is in use: a request still decoding, then the
probe's first hooked call, which meets the allocator in use and adopts what it finds."""

import torch

from kvdoctor.demo.workload import Engine, Request
from kvdoctor.probe.core import runtime
from kvdoctor.trace.reader import iter_events


def live_request(engine: Engine, tokens: int, rid: str = "live-at-attach") -> tuple[Request, torch.Tensor]:
    """A request still decoding: its row and slots are in use (keep the request, as the scheduler
    would)."""
    req = Request(rid)
    (row,) = engine.req_pool.alloc([req])
    req.kv.req_pool_idx = row
    slots = engine.allocator.alloc(tokens)
    engine.req_pool.write((row, slice(0, tokens)), slots.to(torch.int32))
    req.kv.kv_allocated_len = tokens
    return req, slots


def attach_late(engine: Engine, trace: str) -> list:
    """Activates the probe, makes its first hooked call on the allocator in use, deactivates it,
    and returns the trace's events."""
    probe = runtime.activate(trace)
    try:
        assert probe is not None
        extra = engine.allocator.alloc(4)
        engine.allocator.free(extra)
    finally:
        runtime.deactivate()
    return list(iter_events(trace))
