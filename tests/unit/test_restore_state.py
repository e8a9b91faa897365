"""The allocator's `restore_state(state)` in the slot ledger: EAGLE's draft (SGLang's first
speculative worker) takes its slots with `backup_state=True` and gives them back by setting the free
lists back, with no `free`. The ledger follows both ways, on the host path and on the device path
(torch tensors, nothing read back)."""

import numpy as np
import pytest
import torch

from kvdoctor.probe.base.vocabulary import FREE, OWNED, RESERVED
from kvdoctor.probe.ledgers import arrays
from kvdoctor.probe.ledgers import slots as L


def ledger(events, xp):
    return L.SlotLedger(
        name="t",
        size=32,
        page_size=4,
        device="cpu",
        emit=lambda n, a: events.append(a),
        requests=L.RequestTable(),
        sites=L.CallSites(),
        xp=xp,
    )


def slots_of(pages, page_size=4):
    return (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).reshape(-1)


@pytest.mark.parametrize("xp", [arrays.HostArrays(), arrays.DeviceArrays("cpu")], ids=["host", "device"])
def test_restore_frees_what_was_handed_out_since_the_backup_and_holds_what_was_freed_since(xp):
    events = []
    led = ledger(events, xp)
    free_pages, release_pages = torch.arange(1, 9), torch.empty(0, dtype=torch.int64)
    led.on_alloc(slots_of([1, 2]), 1, only_page_starts=True)  # a request's pages
    free_pages = free_pages[2:]
    backup = (free_pages, release_pages)  # backup_state()
    led.on_alloc(slots_of([3, 4]), 2, only_page_starts=True)  # the draft's pages
    free_pages = free_pages[2:]
    led.on_free(slots_of([2]), 3, evicting=False)  # a page freed between backup and restore
    free_pages = torch.cat((torch.tensor([2]), free_pages))
    led.on_restore(backup, (free_pages, release_pages), 4)  # restore_state(backup)
    state = xp.to_host(led.state)
    assert state[3] == state[4] == FREE  # handed back without a free
    assert state[2] == OWNED and xp.to_host(led.alloc_site)[2] == 4  # the restore lost its free: held by nobody
    assert state[0] == state[led.sink] == RESERVED
    led.on_alloc(slots_of([3]), 5, only_page_starts=True)  # the next allocation takes the draft's page again
    led.poll(force=True)
    assert events == []  # no double allocation
    final = xp.to_host(led.state)
    assert sorted(np.flatnonzero(final == FREE).tolist()) == [4, 5, 6, 7, 8]  # what the allocator's lists hold


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_restore_is_followed_without_a_synchronisation():
    from kvdoctor.probe.engines.sglang.speculative import taken_since

    led = L.SlotLedger(
        name="gpu", size=4096, page_size=16, device="cuda", emit=lambda n, a: None, requests=L.RequestTable(), sites=L.CallSites()
    )
    free_pages, release_pages = torch.arange(1, 257, device="cuda"), torch.empty(0, dtype=torch.int64, device="cuda")
    backup = (free_pages, release_pages)
    led.on_alloc(slots_of([1, 2, 3], 16).cuda(), 1, only_page_starts=True)
    current = (free_pages[3:], release_pages)
    again = slots_of([1, 2, 3], 16).cuda()  # (copied before: a copy from pageable memory synchronises)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        led.on_restore(backup, current, 2)
        led.on_alloc(again, 3, only_page_starts=True)
        taken = taken_since(backup, current)  # the usual draft step: only the pages taken are touched
        led.on_free(taken, 4, evicting=False, as_pages=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert taken.tolist() == [1, 2, 3]
    assert np.flatnonzero(led.xp.to_host(led.state) == FREE).tolist() == list(range(1, 257))


@pytest.mark.parametrize("xp", [arrays.HostArrays(), arrays.DeviceArrays("cpu")], ids=["host", "device"])
def test_a_restore_after_allocations_only_is_followed_in_the_pages_taken_with_the_same_result(xp):
    """The draft's usual step: pages taken from the front of the free list (a view of the backed-up
    one) and nothing freed. The role then works in the pages taken, not in the pool; the ledger must
    end exactly as the whole-list comparison leaves it."""
    from kvdoctor.probe.engines.sglang.speculative import taken_since

    fast, full = ledger([], xp), ledger([], xp)
    free_pages, release_pages = torch.arange(1, 9), torch.empty(0, dtype=torch.int64)
    for led in (fast, full):
        led.on_alloc(slots_of([1, 2]), 1, only_page_starts=True)
        led.on_tree_insert(slots_of([1]), 2)
    backup = (free_pages[2:], release_pages)
    current = (backup[0][3:], release_pages)  # the draft took pages 3, 4 and 5
    for led in (fast, full):
        led.on_alloc(slots_of([3, 4, 5]), 3, only_page_starts=True)
    taken = taken_since(backup, current)
    assert taken is not None and taken.tolist() == [3, 4, 5]
    fast.on_free(taken, 4, evicting=False, as_pages=True)
    full.on_restore(backup, current, 4)
    for name in ("state", "owner", "alloc_site"):
        assert np.array_equal(xp.to_host(getattr(fast, name)), xp.to_host(getattr(full, name))), name


def test_a_free_or_a_new_free_list_since_the_backup_takes_the_whole_comparison():
    from kvdoctor.probe.engines.sglang.speculative import taken_since

    free_pages, release_pages = torch.arange(1, 9), torch.empty(0, dtype=torch.int64)
    backup = (free_pages, release_pages)
    assert taken_since(backup, (free_pages[2:], torch.cat((torch.tensor([9]), release_pages)))) is None  # a free
    assert taken_since(backup, (free_pages[2:].clone(), release_pages)) is None  # the lists merged anew
    assert taken_since(backup, (torch.cat((torch.tensor([2]), free_pages[2:])), release_pages)) is None
    assert taken_since(backup, (free_pages[:5], release_pages)) is None  # not a suffix of the backed-up list
    assert taken_since(backup, (free_pages, release_pages)).numel() == 0  # nothing taken
