"""On the GPU: the ledger's Triton kernels against its torch path over random op sequences, and
the time each takes per hooked call (the kernels are what a CUDA ledger uses). Three launch paths:
Triton's own (`triton`), the compiled kernel through Triton's launcher (`compiled`), and through
the CUDA driver from the native path (`direct`, ledger/launch.py). The ops include a paged
alloc's last_loc check and its update, which the kernels' path makes in one launch. Run it with
KVDOCTOR_LEDGER_LAUNCH=direct, so that the driver launch is on for the releases not yet checked."""

import json
import random
import time

import torch

from kvdoctor.probe.ledgers import slots as L


def make(kernels, size, ps, launch="compiled"):
    led = L.SlotLedger(
        name="t", size=size, page_size=ps, device="cuda", emit=lambda n, a: None, requests=L.RequestTable(), sites=L.CallSites()
    )
    if not kernels:
        led.kernels = None
    else:
        assert led.kernels is not None
        for launcher in led.kernels.launchers():
            launcher.enabled = launcher.enabled and launch in ("compiled", "direct")
            if launch != "direct":
                launcher.driver = None
    return led


def compiled_launches(led):
    return sum(launcher.fast_launches for launcher in led.kernels.launchers())


def driver_launches(led):
    return sum(launcher.driver_launches for launcher in led.kernels.launchers())


def main():
    import triton

    out = {"triton": triton.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    # the torch path, the kernels through Triton's launcher, the kernels launched compiled: each
    # kernel ledger against the torch one, op for op, including unaligned index views
    seeds = 0  # over the three launch paths: 20 each
    for launch in ("triton", "compiled", "direct"):
        mismatches = 0
        fast = driven = 0
        for seed in range(20):
            rng = random.Random(seed)
            ps = rng.choice([1, 16])
            size = 256 * ps
            a, b = make(False, size, ps), make(True, size, ps, launch)
            rows = size + ps
            for step in range(80):
                op = rng.choice(["alloc", "free", "freepages", "tree", "owner", "ownerrows", "lastloc", "evict", "lastlocalloc"])
                n = rng.randint(1, 40) if rng.random() < 0.8 else rng.randint(500, 1200)  # one program, or several
                base = torch.tensor(
                    [rng.randrange(-3, rows + 3) if rng.random() < 0.1 else rng.randrange(0, rows) for _ in range(2 * n)],
                    dtype=rng.choice([torch.int64, torch.int32]),
                    device="cuda",
                )
                pick = rng.random()
                # a view one element in (not 16-byte aligned), every other element (strided), or plain
                idx = base[1 : n + 1] if pick < 0.3 else base[::2] if pick < 0.5 else base[:n]
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
                    elif op == "ownerrows":
                        # a row per index, the same for every index of one page (as a request's row is):
                        # two requests written to one page in one call would leave either, on any path
                        led.on_owner(idx, (idx // ps % 7).to(torch.int32))
                    elif op == "lastloc":
                        led.check_last_loc(idx, site, torch.full_like(idx, 3))
                    else:  # a paged alloc's last_loc (with rows or without), then its slots: one launch on the kernels' path
                        last = base[n : n + max(1, n // 4)]
                        led.on_last_loc_alloc(last, torch.full_like(last, 3) if site % 2 else None, idx, site, True)
            # (oor_value is kept differently by the two paths: the worst value, or the worst each side)
            for k in ("state", "owner", "flags", "violation_site", "counters"):
                if not torch.equal(getattr(a, k), getattr(b, k)):
                    mismatches += 1
                    out.setdefault(f"first_mismatch_{launch}", f"seed {seed} {k}")
            fast += compiled_launches(b)
            driven += driver_launches(b)
            launchers = b.kernels.launchers()
            out[f"launch_{launch}"] = {
                "enabled": [x.enabled for x in launchers],
                "declined": [x.declined for x in launchers],
                "driver_declined": [x.driver_declined for x in launchers],
                "keyable": b.kernels.keyable,
                "cached": [len(x.compiled) for x in launchers],
            }
            seeds += 1
        out[f"mismatches_{launch}"] = mismatches
        out[f"compiled_launches_{launch}"] = fast
        out[f"driver_launches_{launch}"] = driven
    out["seeds"] = seeds
    out["mismatches"] = out["mismatches_triton"] + out["mismatches_compiled"] + out["mismatches_direct"]
    # host time per hooked call (an alloc and a free of 32 slots each), the host waiting only at the end
    for name, kernels, launch in (
        ("torch", False, ""),
        ("kernels_triton", True, "triton"),
        ("kernels_compiled", True, "compiled"),
        ("kernels_direct", True, "direct"),
    ):
        led = make(kernels, 65536, 1, launch)
        idx = torch.arange(1, 33, device="cuda")
        for _ in range(50):
            led.on_alloc(idx, 1, only_page_starts=False)
            led.on_free(idx, 1, evicting=False)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        t0 = time.perf_counter()
        for _ in range(2000):
            led.on_alloc(idx, 1, only_page_starts=False)
            led.on_free(idx, 1, evicting=False)
        t = time.perf_counter() - t0
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        out["us_per_call_" + name] = round(t / 4000 * 1e6, 2)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
