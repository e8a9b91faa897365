"""What the prefill row writer (`write_cache_indices`, role req_write_extend) gives the slot ledger.

Its prefix part joins `prefix_tensors` by the host's `prefix_lens_cpu`, as the kernel reads
`pre_lens[pid]` values through each pointer; SGLang passes an empty host tensor for a request with
no prefix beside device tensors for the others, which is never joined. The role applies ownership
after every call, also where SGLang's fallback already wrote the rows through the hooked
`ReqToTokenPool.write`: the ledger must read the same after the second application, on the host
and on the device path.
"""

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import SUPPORT  # noqa: E402

from kvdoctor.probe.engines.sglang.prefill import joined_prefixes  # noqa: E402
from kvdoctor.probe.ledgers import arrays  # noqa: E402

sys.path.insert(0, SUPPORT)
from slot_ledgers import quiet_ledger  # noqa: E402

CUDA = torch.cuda.is_available()


def test_the_prefixes_are_joined_by_the_hosts_counts():
    empty_on_host = torch.empty((0,), dtype=torch.int64)
    prefixes = [torch.tensor([5, 6, 7, 8]), empty_on_host, torch.tensor([9, 10], dtype=torch.int32)]
    joined = joined_prefixes(prefixes, torch.tensor([3, 0, 2]), "cpu")
    assert joined.tolist() == [5, 6, 7, 9, 10] and joined.dtype == torch.int64  # what each program loads


@pytest.mark.parametrize(
    "prefixes,counts",
    [
        ([torch.tensor([5])], torch.tensor([2])),  # shorter than its count: left out, not given to the wrong rows
        ([torch.tensor([5]), torch.tensor([6])], torch.tensor([1])),  # not one count per tensor
        ([torch.tensor([5])], torch.tensor([0])),  # no prefix at all
        ((), torch.tensor([], dtype=torch.int64)),
        (None, torch.tensor([1])),
    ],
)
def test_prefixes_that_cannot_be_joined_exactly_are_left_out(prefixes, counts):
    assert joined_prefixes(prefixes, counts, "cpu") is None


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_counts_on_the_device_are_not_read_back():
    assert joined_prefixes([torch.tensor([5], device="cuda")], torch.tensor([1], device="cuda"), "cuda") is None


def _ledger(xp, page_size):
    return quiet_ledger(1024, page_size, xp=xp)


def _readback(ledger):
    to_host = ledger.xp.to_host
    return [np.asarray(to_host(a)).copy() for a in (ledger.state, ledger.owner, ledger.flags, ledger.counters)]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("where", ["host", "device"])
def test_the_same_ownership_applied_twice_reads_as_once(where, page_size):
    ledger = _ledger(arrays.HostArrays() if where == "host" else arrays.DeviceArrays("cpu"), page_size)
    owned = torch.arange(4 * page_size, 10 * page_size, dtype=torch.int64)
    tree = torch.arange(20 * page_size, 22 * page_size, dtype=torch.int64)
    ledger.on_alloc(owned, 1, only_page_starts=False)
    ledger.on_alloc(tree, 1, only_page_starts=False)
    ledger.on_tree_insert(tree, 2)
    free = torch.arange(30 * page_size, 31 * page_size, dtype=torch.int64)  # never allocated
    slots = torch.cat([owned, tree, free])
    rows = torch.cat([torch.full((owned.numel(),), 3), torch.full((tree.numel(),), 4), torch.full((free.numel(),), 5)])
    ledger.on_owner(slots, rows)
    once = _readback(ledger)
    ledger.on_owner(slots, rows)
    twice = _readback(ledger)
    assert all(np.array_equal(a, b) for a, b in zip(once, twice, strict=True))
    state, owner = once[0], once[1]

    def pages(slots):
        return np.unique(slots.numpy() // page_size)

    assert (owner[pages(owned)] == 3).all()  # the request's own pages take its row
    assert (owner[pages(tree)] == -1).all() and (owner[pages(free)] == -1).all()  # the tree's and free pages do not
    assert (state[pages(free)] == 1).all() and not once[3].any()  # nothing changed state, no violation counted
