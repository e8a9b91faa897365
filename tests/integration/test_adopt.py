"""A probe that arrives late (attach, or any activation after the engine started) adopts the state it
finds, on SGLang's real allocator, radix trees and request pool: what leaked before it arrived is
named exactly, what the tree or a live request holds is not."""

import sys

import pytest
import torch
from conftest import SUPPORT

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.demo.workload import Engine, WorkloadConfig, run_workload
from kvdoctor.probe.core import runtime
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

sys.path.insert(0, SUPPORT)
from late_attach import attach_late, live_request


@pytest.mark.parametrize("fault,tree", [("leak", "radix"), ("none", "radix"), ("leak", "unified"), ("none", "unified")])
def test_a_late_probe_names_exactly_what_leaked_before_it(tmp_path, fault, tree):
    engine = Engine(pool_tokens=4096, page_size=1, tree=tree)
    result = run_workload(WorkloadConfig(fault=fault, tree=tree), engine=engine)  # no probe yet
    _req, held = live_request(engine, 24)  # the request is kept, as the scheduler would
    assert engine.sglang_leak_check()["diff"] == result.planted.get("orphan_slots", 0) + int(held.numel())

    events = attach_late(engine, str(tmp_path / "late.kvtrace.json"))  # the first hooked call meets the allocator in use
    adopted = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("adopted")]
    assert len(adopted) == 1 and adopted[0]["live_requests"] == 1 and adopted[0]["rows_read_whole"] == 0
    assert adopted[0]["held_by_no_one_slots"] == result.planted.get("orphan_slots", 0)
    assert adopted[0]["verified"], adopted[0]["books"]  # the books agree with SGLang's own counters
    books = adopted[0]["books"]
    assert books["sglang_available_slots"] == books["free_read_slots"] == adopted[0]["free_slots"]
    assert books["sglang_tree_slots"] == books["tree_read_slots"] == engine.tree.evictable_size() + engine.tree.protected_size() > 0

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


def _ledger(size: int, page_size: int):
    from kvdoctor.probe.base.callsites import CallSites
    from kvdoctor.probe.ledgers.requests import RequestTable
    from kvdoctor.probe.ledgers.slots import SlotLedger

    return SlotLedger(
        name="check", size=size, page_size=page_size, device="cpu", emit=lambda *a, **k: None, requests=RequestTable(), sites=CallSites()
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_fresh_pool_check_counts_distinct_pages_as_unique_does(page_size):
    """Whether to adopt is decided by counting distinct free pages on a bitmap; it must agree with
    counting them by `np.unique` on the real allocator's free list (fresh, in use, freed again)
    and on lists no allocator makes (repeats, numbers past the pool, floats, empty)."""
    import numpy as np

    from kvdoctor.probe.engines.sglang.adopt import host_free_pages, needs_adoption

    def by_unique(ledger, pages):
        return pages is not None and len(np.unique(np.asarray(pages))) < ledger.num_pages

    engine = Engine(pool_tokens=256, page_size=page_size)
    ledger = _ledger(256, page_size)
    n = ledger.num_pages
    fresh = host_free_pages(engine.allocator)
    taken = engine.allocator.alloc(8 * page_size)
    in_use = host_free_pages(engine.allocator)
    engine.allocator.free(taken)
    freed = host_free_pages(engine.allocator)
    cases = [
        fresh,
        in_use,
        freed,
        None,
        [],
        np.arange(1, n + 1)[::-1],
        np.arange(0, n),
        np.r_[np.arange(1, n), 1],
        np.r_[np.arange(1, n + 1), 1],
        np.r_[np.arange(2, n + 1), n + 5],
        np.r_[np.arange(2, n + 1), -3],
        np.arange(1, n + 1, dtype=np.float64),
        torch.arange(1, n + 1, dtype=torch.int32),
        np.arange(1, n + 2),
    ]
    answers = [needs_adoption(ledger, pages) for pages in cases]
    assert answers == [by_unique(ledger, pages) for pages in cases]
    assert answers[:3] == [False, True, False]  # the cases the probe meets: fresh, in use, all returned


def _hide_tree(engine: Engine) -> None:
    """The engine's tree, of a class no probe map names: the adoption cannot find what it holds."""
    engine.tree.__class__ = type("VendorRadixCache", (type(engine.tree),), {})


def _duplicate_a_free_page(engine: Engine) -> None:
    """A free list that names one page twice (what a double free before the attach leaves)."""
    allocator = engine.allocator
    allocator.free_pages = torch.cat([allocator.free_pages, allocator.free_pages[:1]])


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("spoil", [_hide_tree, _duplicate_a_free_page], ids=["tree-hidden", "free-page-twice"])
def test_an_adoption_whose_books_do_not_add_up_judges_nothing_from_before(tmp_path, spoil, page_size):
    """A late probe that cannot prove what it read (a tree it cannot find, a free list SGLang's own
    count disagrees with) names nothing as leaked before it came: a partial probe with the numbers,
    no error; what happens after it came is still judged."""
    engine = Engine(pool_tokens=4096, page_size=page_size)
    result = run_workload(
        WorkloadConfig(fault="leak", page_size=page_size), engine=engine
    )  # no probe yet: one real leak, in the tree's midst
    assert result.planted["orphan_slots"] > 0 and engine.tree.evictable_size() > 0
    spoil(engine)

    trace = tmp_path / "late.kvtrace.json"
    probe = runtime.activate(str(trace))
    try:
        assert probe is not None
        lost = engine.allocator.alloc(4 * page_size)  # the first hooked call adopts the pool; never freed: a leak after
    finally:
        runtime.deactivate()
    events = list(iter_events(str(trace)))
    adopted = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("adopted")]
    assert len(adopted) == 1 and not adopted[0]["verified"]
    assert adopted[0]["held_by_no_one_slots"] == 0 and adopted[0]["unproven_slots"] >= result.planted["orphan_slots"]
    analysis = analyze(iter(events))
    (leak,) = [f for f in analysis.findings if f.severity == "error"]  # only what the probe saw happen
    assert leak.kind == schema.ORPHAN_SLOTS and leak.count == lost.numel() and "before kvdoctor attached" not in leak.message
    assert set(leak.evidence["slot_ids"]) == {int(s) for s in lost}
    (partial,) = [f for f in analysis.findings if f.kind == schema.PROBE_PARTIAL and f.evidence.get("component") == "adoption"]
    books = adopted[0]["books"]
    if spoil is _hide_tree:
        held = engine.tree.evictable_size() + engine.tree.protected_size()
        assert books["tree_read_slots"] == 0 and books["sglang_tree_slots"] == held
        assert f"holds {held} slots" in partial.message and "VendorRadixCache" in partial.message
    else:
        assert books["sglang_available_slots"] == books["free_read_slots"] + page_size
        assert f"says {books['sglang_available_slots']} slots are free" in partial.message
    assert "not judged" in partial.message
    census = [e.args for e in events if e.name == schema.CENSUS][-1]
    assert census["orphan_slots"] == lost.numel() and census["unproven_slots"] == adopted[0]["unproven_slots"]
