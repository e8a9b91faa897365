"""The slot ledger's cost of following `restore_state` (EAGLE v1's draft, once a decode step, SGLang
0.5.2-0.5.11), host ledger, page size 1: the whole-list comparison against the pages-taken path the
role takes when the allocator only took from the front of its free list. Per call, a draft's 32
slots taken back, at each pool size; prints one JSON line.

    .venv/bin/python bench/bench_restore_state.py [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvdoctor.probe.engines.sglang.speculative import taken_since
from kvdoctor.probe.ledgers import slots as L


def per_call_ms(size: int, calls: int, fast: bool) -> float:
    led = L.SlotLedger(
        name="b", size=size, page_size=1, device="cpu", emit=lambda n, a: None, requests=L.RequestTable(), sites=L.CallSites()
    )
    free, release = torch.arange(1, size + 1), torch.empty(0, dtype=torch.int64)
    led.on_alloc(free[:1000], 1, only_page_starts=False)
    backup = (free[1000:], release)
    current = (backup[0][32:], release)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            led.on_alloc(free[1000:1032], 2, only_page_starts=False)  # the draft's allocation
            if fast:
                led.on_free(taken_since(backup, current), 3, evicting=False, as_pages=True)
            else:
                led.on_restore(backup, current, 3)
        best = min(best, (time.perf_counter() - t0) / calls * 1e3)
    return round(best, 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    out = {}
    for size in (65536, 1 << 20):
        whole, taken = per_call_ms(size, a.calls, False), per_call_ms(size, a.calls, True)
        out[str(size)] = {"whole_list_ms": whole, "pages_taken_ms": taken, "ratio": round(whole / taken, 1)}
    print(json.dumps({"alloc_and_restore_per_call": out}))


if __name__ == "__main__":
    main()
