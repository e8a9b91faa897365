"""On the GPU: the ledger's Triton kernels against its torch path over random op sequences, and
the time each takes per hooked call (the kernels are what a CUDA ledger uses)."""

import json
import random
import time

import torch

from kvdoctor.probe.ledger import slots as L


def make(kernels, size, ps):
    led = L.SlotLedger(
        name="t", size=size, page_size=ps, device="cuda", emit=lambda n, a: None, requests=L.RequestTable(), sites=L.CallSites()
    )
    if not kernels:
        led.kernels = None
    else:
        assert led.kernels is not None
    return led


def main():
    out = {"mismatches": 0, "seeds": 0}
    for seed in range(20):
        rng = random.Random(seed)
        ps = rng.choice([1, 16])
        size = 256 * ps
        a, b = make(False, size, ps), make(True, size, ps)
        rows = size + ps
        for step in range(80):
            op = rng.choice(["alloc", "free", "freepages", "tree", "owner", "lastloc", "evict"])
            n = rng.randint(1, 40)
            idx = torch.tensor(
                [rng.randrange(-3, rows + 3) if rng.random() < 0.1 else rng.randrange(0, rows) for _ in range(n)],
                dtype=torch.int64,
                device="cuda",
            )
            site = rng.randrange(1, 50)
            for led in (a, b):
                if op == "alloc":
                    led.on_alloc(idx, site, only_page_starts=(step % 2 == 0))
                elif op in ("free", "evict"):
                    led.on_free(idx, site, evicting=op == "evict")
                elif op == "freepages":
                    led.on_free(idx // ps, site, evicting=False, as_pages=True)
                elif op == "tree":
                    led.on_tree_insert(idx, site)
                elif op == "owner":
                    led.on_owner(idx, 7)
                else:
                    led.check_last_loc(idx, site, torch.full_like(idx, 3))
        for k in ("state", "owner", "flags", "violation_site", "counters"):
            if not torch.equal(getattr(a, k), getattr(b, k)):
                out["mismatches"] += 1
                out.setdefault("first_mismatch", f"seed {seed} {k}")
        out["seeds"] += 1
    # cost per call, with the host waiting only at the end
    for kernels in (False, True):
        led = make(kernels, 65536, 1)
        idx = torch.arange(1, 33, device="cuda")
        for _ in range(50):
            led.on_alloc(idx, 1, only_page_starts=False)
            led.on_free(idx, 1, evicting=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            led.on_alloc(idx, 1, only_page_starts=False)
            led.on_free(idx, 1, evicting=False)
        torch.cuda.synchronize()
        out["us_per_call_" + ("kernels" if kernels else "torch")] = round((time.perf_counter() - t0) / 1000 * 1e6, 1)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
