"""The ledger's device path (torch tensors, no value read on the hot path), run on CPU tensors.

On a GPU the same code runs with CUDA tensors; here we check that it finds the same violations
as the host path, with its evidence read back asynchronously by poll()."""

import torch

from kvdoctor.probe.ledgers import arrays
from kvdoctor.probe.ledgers import slots as L


def device_ledger(events, size=64, page_size=1):
    return L.SlotLedger(
        name="t",
        size=size,
        page_size=page_size,
        device="cpu",
        emit=lambda n, a: events.append(a),
        requests=L.RequestTable(),
        sites=L.CallSites(),
        xp=arrays.DeviceArrays("cpu"),
    )


def test_device_path_finds_what_the_host_path_finds():
    events = []
    led = device_ledger(events)
    slots = torch.arange(1, 9)
    led.on_alloc(slots, 1, only_page_starts=False)
    led.on_free(slots, 2, evicting=False)
    led.on_free(slots[:3], 3, evicting=False)  # 3 slots freed twice
    led.on_alloc(torch.tensor([2, 3]), 4, only_page_starts=False)
    led.on_alloc(torch.tensor([2]), 4, only_page_starts=False)  # handed out twice
    led.on_alloc(torch.tensor([65 + 1]), 5, only_page_starts=False)  # one past the buffer (rows = 65)
    led.check_last_loc(torch.tensor([7, -1]), 6)  # 7 is free: stale
    assert events == []  # nothing read back yet
    led.poll(force=True)
    got = {e["kind"]: e for e in events}
    assert got["double_free"]["count"] == 3 and got["double_free"]["slot_ids"] == [1, 2, 3]
    assert got["double_alloc"]["count"] == 1 and got["double_alloc"]["slot_ids"] == [2]
    assert got["index_out_of_range"]["bad_index"] == 66
    assert got["stale_last_loc"]["count"] == 1 and got["stale_last_loc"]["slot_ids"] == [7]


def test_device_counters_are_read_one_poll_later():
    led = device_ledger([])
    assert led.counter_args_async() is None
    counts = led.counter_args_async()
    assert counts["free_slots"] == 64 and counts["total_slots"] == 64
