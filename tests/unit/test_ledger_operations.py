"""One table of ledger-operation cases, run alike against each implementation of the slot ledger's
rules: the numpy ledger (SlotLedger's host path), the torch ledger on CPU tensors (its device path,
what runs on a GPU) and the native path's C (`apply_op` on a registered host ledger, the update a
fast path makes). Each case prepares the same pages, applies one operation, and each implementation
must give the same verdict (healthy, or which violation), and leave the same ledger: where the C
finds a call not healthy it writes nothing and the Python method records it, as a fast path hands
such a call back."""

from __future__ import annotations

import pytest
import torch

from kvdoctor.probe import native
from kvdoctor.probe.ledgers import arrays
from kvdoctor.probe.ledgers import slots as L
from kvdoctor.trace import schema

SIZE = 64

# (case, pages prepared by these operations, the operation, its slots, its options, the violation or None)
CASES = [
    ("alloc of free slots", [], "alloc", [3, 4], {}, None),
    ("alloc of a slot already handed out", [("alloc", [3], {})], "alloc", [3, 5], {}, schema.DOUBLE_ALLOC),
    ("alloc past the pool", [], "alloc", [SIZE + 3], {}, schema.INDEX_OUT_OF_RANGE),
    ("free of slots handed out", [("alloc", [3, 4], {})], "free", [3, 4], {}, None),
    ("free of a free slot", [], "free", [5], {}, schema.DOUBLE_FREE),
    ("free of a tree slot outside an eviction keeps the tree bit", [("alloc", [6], {}), ("tree_in", [6], {})], "free", [6], {}, None),
    ("free inside an eviction clears the tree bit", [("alloc", [6], {}), ("tree_in", [6], {})], "free", [6], {"evicting": True}, None),
    ("tree-in of slots handed out", [("alloc", [7, 8], {})], "tree_in", [7, 8], {}, None),
    ("tree-in of a freed slot", [("alloc", [7], {}), ("free", [7], {})], "tree_in", [7], {}, schema.USE_AFTER_FREE),
    ("owner write of slots handed out", [("alloc", [9, 10], {})], "owner", [9, 10], {"row": 2}, None),
    ("owner write of a free slot changes nothing", [], "owner", [11], {"row": 2}, None),
    ("last-loc in a page still held", [("alloc", [12], {})], "last_loc", [12, -1], {}, None),
    ("last-loc in a free page", [("alloc", [12], {}), ("free", [12], {})], "last_loc", [12], {}, schema.STALE_LAST_LOC),
    ("free naming a slot twice in one call", [("alloc", [3, 4], {})], "free", [3, 4, 3], {}, schema.DOUBLE_FREE),
    ("alloc naming a slot twice in one call", [], "alloc", [5, 6, 5], {}, schema.DOUBLE_ALLOC),
]
# The torch ledger (a GPU's) does not sort each call's pages: a page named twice in one call is missed there.
DEVICE_MISSES = {"free naming a slot twice in one call", "alloc naming a slot twice in one call"}


def _ledger(xp, events):
    return L.SlotLedger(
        name="t",
        size=SIZE,
        page_size=1,
        device="cpu",
        emit=lambda name, args: events.append(args),
        requests=L.RequestTable(),
        sites=L.CallSites(),
        xp=xp,
    )


def _python(ledger, op, slots, options, site=1):
    """The operation through the Python ledger's own method."""
    with ledger.lock:
        if op == "alloc":
            ledger.on_alloc(slots, site, only_page_starts=False)
        elif op == "free":
            ledger.on_free(slots, site, evicting=options.get("evicting", False))
        elif op == "tree_in":
            ledger.on_tree_insert(slots, site)
        elif op == "owner":
            ledger.on_owner(slots, options["row"])
        else:
            ledger.check_last_loc(slots, site)


def _native(ledger, key, op, slots, options, site=1):
    """The operation as a fast path makes it: the C's checked update, else the Python method."""
    value = {"alloc": site, "free": int(options.get("evicting", False)), "owner": options.get("row", 0)}.get(op, 0)
    healthy = native.NATIVE.apply_op(key, op, slots, 0, value)
    if not healthy:
        _python(ledger, op, slots, options, site)
    return healthy


def _outcome(ledger, events):
    ledger.poll(force=True)
    state = {name: torch.as_tensor(getattr(ledger, name)).clone() for name in ("state", "owner", "alloc_site")}
    return sorted({e["kind"] for e in events if "kind" in e}), state


@pytest.mark.skipif(not native.active(), reason="the native path is not built here")
@pytest.mark.parametrize("case, prepared, op, slots, options, violation", CASES, ids=[c[0] for c in CASES])
def test_each_implementation_of_a_rule_gives_the_same_verdict_and_ledger(case, prepared, op, slots, options, violation):
    native.ensure_torch()
    outcomes = {}
    keys = []
    try:
        for name in ("numpy", "torch", "native"):
            events: list = []
            ledger = _ledger(arrays.DeviceArrays("cpu") if name == "torch" else None, events)
            key = object()  # what the C keys a host ledger by (an allocator)
            if name == "native":
                assert native.register_ledger(key, ledger, {}), "the C takes this ledger"
                keys.append(key)
            for prep_op, prep_slots, prep_options in prepared:
                _python(ledger, prep_op, torch.tensor(prep_slots), prep_options)
            events.clear()
            index = torch.tensor(slots)
            if name == "native":
                healthy = _native(ledger, key, op, index, options)
                assert healthy == (violation is None), f"the C judged {case!r} {'healthy' if healthy else 'not healthy'}"
            else:
                _python(ledger, op, index, options)
            outcomes[name] = _outcome(ledger, events)
    finally:
        if keys and not native.NATIVE.stats()["depth"]:
            native.reset()  # forgets the ledgers registered here (a probe, if any, registers its own again)
    expected = [violation] if violation else []
    for name, (kinds, state) in outcomes.items():
        if name == "torch" and case in DEVICE_MISSES:
            assert kinds == [], kinds  # said in DeviceArrays.or_repeated
            continue
        assert kinds == expected, (name, kinds)
        for field, values in state.items():
            assert torch.equal(values, outcomes["numpy"][1][field]), (name, field)


@pytest.mark.skipif(not native.active(), reason="the native path is not built here")
@pytest.mark.parametrize("op, slots", [("free", [3, 4, SIZE + 3]), ("free", [3, 4, 4]), ("alloc", [5, 6, 6]), ("alloc", [5, 6, SIZE + 9])])
def test_a_check_that_fails_leaves_no_mark_behind(op, slots):
    """The C marks each page its check passes (a page named twice in one call meets its own mark);
    a check that fails part way clears them: not healthy, nothing written."""
    native.ensure_torch()
    ledger, key = _ledger(None, []), object()
    try:
        assert native.register_ledger(key, ledger, {})
        if op == "free":
            _python(ledger, "alloc", torch.tensor([3, 4]), {})
        before = ledger.state.copy()
        assert native.NATIVE.apply_op(key, op, torch.tensor(slots), 0, 1) is False
        assert (ledger.state == before).all(), (before[:8], ledger.state[:8])
        assert native.NATIVE.apply_op(key, op, torch.tensor(slots[:2]), 0, 1) is True  # the healthy part alone passes
    finally:
        if not native.NATIVE.stats()["depth"]:
            native.reset()
