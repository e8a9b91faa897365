"""Speculative decoding's row writes (`assign_req_to_token_pool_func`) as the slot ledger reads them.

`written_spans` turns the kernel's arguments into (slot, row) pairs on the tensors' device. The
reference is the kernel itself, written out: program `pid` copies `out_cache_loc[offset : offset +
end - start]` into row `req_pool_indices[pid]`, columns `start:end`, `offset` being the sum of
`end - start` over the programs before it (SGLang 0.5.23, mem_cache/allocation.py). On a GPU the
same pairs are taken with no value read back: torch's sync debug mode raises on any
synchronisation (the CUDA cases run where a GPU is present).
"""

import random
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import SUPPORT  # noqa: E402

from kvdoctor.probe.engines.sglang.speculative import written_spans  # noqa: E402
from kvdoctor.probe.ledgers import arrays  # noqa: E402

sys.path.insert(0, SUPPORT)
from slot_ledgers import quiet_ledger  # noqa: E402

CUDA = torch.cuda.is_available()


def kernel_writes(rows, starts, ends, values, batch_size, width):
    """The rows the kernel leaves, as {(row, column): slot}."""
    table = torch.full((int(rows.max()) + 1, width), -1, dtype=torch.int64)
    offset = 0
    for pid in range(batch_size):
        start, end, row = int(starts[pid]), int(ends[pid]), int(rows[pid])
        if end > start:
            table[row, start:end] = values[offset : offset + end - start]
        offset += end - start
    return {(r, c): int(table[r, c]) for r, c in zip(*np.nonzero(table.numpy() >= 0), strict=True)}


def a_batch(draw, batch_size, spare=0):
    """Distinct rows, some spans empty (a request that needs no new slot this step)."""
    rows = torch.tensor(draw.sample(range(1, 64), batch_size), dtype=torch.int64)
    starts = torch.tensor([draw.randint(0, 40) for _ in range(batch_size)], dtype=torch.int32)
    ends = starts + torch.tensor([draw.choice([0, 1, 3, 4, 8, 16]) for _ in range(batch_size)], dtype=torch.int32)
    needed = int((ends - starts).sum())
    values = torch.tensor(draw.sample(range(1, 4096), needed + spare), dtype=torch.int64)
    return rows, starts, ends, values


@pytest.mark.parametrize("seed", range(20))
def test_the_pairs_are_the_kernels_writes(seed):
    draw = random.Random(seed)
    batch_size = draw.randint(1, 12)
    rows, starts, ends, values = a_batch(draw, batch_size, spare=draw.choice([0, 0, 5]))
    written = kernel_writes(rows, starts, ends, values, batch_size, 64)
    spans = written_spans(rows, starts, ends, values, batch_size)
    if not written:
        assert spans is None or bool((spans[0] < 0).all())
        return
    slots, owners, batch_rows, batch_ends = spans
    got = sorted((int(s), int(o)) for s, o in zip(slots, owners, strict=True) if s >= 0)
    assert got == sorted((slot, row) for (row, _), slot in written.items())
    assert int((slots < 0).sum()) == values.numel() - len(written)  # entries past the last span: not written
    assert torch.equal(batch_rows, rows) and batch_ends.tolist() == [
        e if e > s else 0 for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
    ]


def test_only_the_first_batch_size_requests_are_written():
    rows, starts, ends = torch.tensor([3, 5]), torch.tensor([0, 0]), torch.tensor([2, 2])
    slots, owners, _, _ = written_spans(rows, starts, ends, torch.tensor([11, 12, 13, 14]), 1)
    assert slots.tolist() == [11, 12, -1, -1] and owners.tolist()[:2] == [3, 3]
    assert written_spans(rows, starts, ends, torch.tensor([], dtype=torch.int64), 2) is None


def _ledger(xp, page_size):
    return quiet_ledger(4096, page_size, xp=xp)


def _expected_owner(ledger, rows, starts, ends, values, batch_size):
    owner = np.full(ledger.num_pages + 2, -1)
    for (row, _), slot in kernel_writes(rows, starts, ends, values, batch_size, 64).items():
        owner[slot // ledger.page_size] = row
    return owner


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("where", ["host", "device"])
def test_a_ledger_gives_each_written_slot_its_row(where, page_size):
    draw = random.Random(page_size)
    batch_size = 8
    rows, starts, ends, values = a_batch(draw, batch_size)
    if page_size > 1:  # whole pages, as the paged allocator hands them out
        values = torch.arange(page_size, page_size + values.numel(), dtype=torch.int64)
    ledger = _ledger(arrays.HostArrays() if where == "host" else arrays.DeviceArrays("cpu"), page_size)
    ledger.on_alloc(values, 1, only_page_starts=False)
    slots, owners, _, _ = written_spans(rows, starts, ends, values, batch_size)
    ledger.on_owner(slots, owners)
    owner = np.asarray(ledger.xp.to_host(ledger.owner) if where == "device" else ledger.owner)
    expected = _expected_owner(ledger, rows, starts, ends, values, batch_size)
    if page_size == 1:
        assert np.array_equal(owner, expected)
    else:  # a page shared by two requests' spans goes to one of them; each page is owned by a writer of it
        written = expected >= 0
        assert bool((owner[written] >= 0).all()) and set(owner[written].tolist()) <= set(rows.tolist())


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("page_size", [1, 16])
def test_on_a_gpu_the_rows_are_taken_without_a_synchronisation(page_size):
    draw = random.Random(7)
    batch_size = 32
    rows, starts, ends, values = a_batch(draw, batch_size)
    ledger = quiet_ledger(4096, page_size, device="cuda", name="gpu")
    args = [t.cuda() for t in (rows, starts, ends, values)]
    ledger.on_alloc(args[3], 1, only_page_starts=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        slots, owners, _, _ = written_spans(*args, batch_size)
        ledger.on_owner(slots, owners)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    owner = ledger.xp.to_host(ledger.owner)
    expected = _expected_owner(ledger, rows, starts, ends, values, batch_size)
    written = expected >= 0
    if page_size == 1:
        assert np.array_equal(owner[written], expected[written])
    else:
        assert bool((owner[written] >= 0).all())
