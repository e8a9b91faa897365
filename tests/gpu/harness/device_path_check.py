"""On the GPU: the ledger's alloc and free launched from the native fast path (csrc/launch.c) against the
same calls on the Python path, through SGLang 0.5.9's real `TokenToKVPoolAllocator` with the probe.

Two allocators in one process take the same seeded sequence of calls: the first with
KVDOCTOR_LEDGER_LAUNCH=driver (every call on the Python path: its kernels launched through the
driver from Python), the second with the native fast path on. Calls of one block or less, more than a
block, int32 and unaligned index views, and faults (a double free, which SGLang's free list then
hands out twice: double allocations follow). Each allocation is written into a real
`ReqToTokenPool` (the owner kernel): into one row, or a row per slot as a decode step writes, with
int64 and int32 slots and rows that start unaligned; each allocator in turn is the one whose slots
the request rows point at. The loop runs under
torch.cuda.set_sync_debug_mode("error"). At the end (a sync is fine there) every array of the two
ledgers is compared, and the counters named. Prints RESULT {json}.
"""

from __future__ import annotations

import json
import os
import random
import sys


def write(pool, out, rng, torch, table) -> int:
    """The slots just allocated written into the request table, one of three ways."""
    n = out.numel()
    way = rng.choice(["one row", "one row int32", "rows", "int32 rows"])
    if way.startswith("one row"):
        pool.write((rng.randrange(64), slice(0, n)), out.to(torch.int32) if way == "one row int32" else out)
    else:  # a batched write takes int32 slots, as SGLang's decode gives it
        start = rng.randrange(64)  # rows and columns are views at any offset: aligned or not
        rows = table["rows32" if way == "int32 rows" else "rows"][start : start + n]
        pool.write((rows, table["columns"][start : start + n]), out.to(torch.int32))
    return 1


def drive(allocator, pool, torch, seed: int, table) -> int:
    rng = random.Random(seed)
    held: list = []
    freed_once = None
    calls = 0
    for step in range(400):
        if held and (rng.random() < 0.45 or allocator.available_size() < 700):
            t = held.pop(rng.randrange(len(held)))
            way = rng.choice(["whole", "int32", "views"])
            if way == "whole":
                allocator.free(t)
                calls += 1
                if freed_once is None and step > 100:
                    freed_once = t
            elif way == "int32":
                allocator.free(t.to(torch.int32))
                calls += 1
            else:  # an unaligned view, then the rest
                if t.numel() > 1:
                    allocator.free(t[1:])
                    allocator.free(t[:1])
                    calls += 2
                else:
                    allocator.free(t)
                    calls += 1
        else:
            n = rng.randint(1, 64) if rng.random() < 0.9 else rng.randint(513, 600)
            out = allocator.alloc(n)
            calls += 1
            if out is not None:
                held.append(out)
                calls += write(pool, out, rng, torch, table)
        if step == 300 and freed_once is not None:
            allocator.free(freed_once)  # a double free (SGLang's free list now holds these slots twice)
            calls += 1
    for t in held:
        allocator.free(t)
        calls += 1
    return calls


def drive_paged(allocator, pool, torch, seed: int, common, device: str) -> int:
    """Requests on a paged allocator as a scheduler runs them: prefills (`alloc_extend` with
    last_loc -1), decode steps (`get_last_loc` over the batch's rows, then `alloc_decode` with it,
    then the batched write), and finished requests freed. Once, a request's pages are freed while it
    still decodes: its last_loc is then stale (a violation both paths must record alike). The
    paged free sorts out its pages with `torch.unique`, SGLang's own synchronisation: the frees run
    outside the sync check (the C free path is checked above, on the token allocator)."""
    rng = random.Random(seed)

    def on_device(values):  # no synchronisation: a pinned copy
        host = torch.tensor(values, dtype=torch.int64)
        return host if device == "cpu" else host.pin_memory().to(device, non_blocking=True)

    def free(row, length):
        torch.cuda.set_sync_debug_mode("default")
        allocator.free(pool.req_to_token[row, :length])
        torch.cuda.set_sync_debug_mode("error")

    active: dict[int, int] = {}
    calls = 0
    for step in range(240):
        idle = [r for r in range(16) if r not in active]
        if idle and (not active or rng.random() < 0.3):
            rows = rng.sample(idle, min(len(idle), rng.randint(1, 3)))
            seq = [rng.randint(1, 40) for _ in rows]
            zeros = [0] * len(rows)
            out = allocator.alloc_extend(
                on_device(zeros), torch.tensor(zeros), on_device(seq), torch.tensor(seq), on_device([-1] * len(rows)), sum(seq)
            )
            calls += 1
            if out is None:
                continue
            start = 0
            for row, length in zip(rows, seq, strict=True):
                pool.write((row, slice(0, length)), out[start : start + length])
                start += length
                active[row] = length
            calls += len(rows)
        elif active and rng.random() < 0.8:
            rows = sorted(active)
            if step == 150:
                free(rows[0], active[rows[0]])  # freed while it still decodes: a stale last_loc next
                calls += 1
            rows_on_device = on_device(rows)
            before = on_device([active[r] for r in rows])
            last = common.get_last_loc_torch(pool.req_to_token, rows_on_device, before)
            after = [active[r] + 1 for r in rows]
            out = allocator.alloc_decode(on_device(after), torch.tensor(after), last)
            calls += 2
            if out is None:
                continue
            pool.write((rows_on_device, before), out.to(torch.int32))
            calls += 1
            for r in rows:
                active[r] += 1
            if step == 150:
                del active[rows[0]]
        elif active:
            row = rng.choice(sorted(active))
            free(row, active.pop(row))
            calls += 1
    for row, length in sorted(active.items()):
        free(row, length)
        calls += 1
    return calls


def run_mode(probe, torch, mode: str, device: str, shape: str) -> tuple[dict, object]:
    """One allocator of `shape` through the seeded calls with its ledger on `mode`'s path."""
    from sglang.srt.mem_cache import common

    if not hasattr(common, "get_last_loc_torch"):  # where later releases keep it (a dry run on 0.5.23)
        from sglang.srt.mem_cache import allocation as common
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvdoctor.probe import native
    from kvdoctor.probe.engines.sglang.state import sglang_state

    os.environ["KVDOCTOR_LEDGER_LAUNCH"] = mode  # read when the allocator's ledger is made
    if shape == "paged":
        allocator = PagedTokenToKVPoolAllocator(4096, 4, dtype=torch.bfloat16, device=device, kvcache=None, need_sort=False)
        allocator.free(allocator.alloc(4))
    else:
        allocator = TokenToKVPoolAllocator(4096, dtype=torch.bfloat16, device=device, kvcache=None, need_sort=False)
        allocator.free(allocator.alloc(1))  # the ledger is made (and its kernels' first launch) here
    state = sglang_state(probe)
    state.primary = state.ledger_for(allocator)  # request rows point at this allocator's slots now
    native.set_primary(allocator)
    pool = ReqToTokenPool(64, 1024, device, False)
    rows = torch.arange(1300, device=device) % 64
    table = {"rows": rows, "rows32": rows.to(torch.int32), "columns": torch.arange(1300, device=device) % 1024}
    torch.cuda.synchronize()
    launches0 = native.NATIVE.stats()["device_launches"]
    err = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls = drive_paged(allocator, pool, torch, 11, common, device) if shape == "paged" else drive(allocator, pool, torch, 7, table)
    except Exception as exc:
        err = f"{type(exc).__name__}: {exc}"
        calls = -1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    ledger = state.ledger_for(allocator)
    result = {
        "error": err,
        "hooked_calls": calls,
        "c_launches": native.NATIVE.stats()["device_launches"] - launches0,
        "counters": [int(c) for c in ledger.counters.tolist()],
    }
    return result, ledger


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"  # "cpu": a dry run of this script (host ledgers)
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(None)
    import torch

    if device == "cpu":
        torch.cuda.set_sync_debug_mode = torch.cuda.synchronize = lambda *a: None
    out = {"gpu": torch.cuda.get_device_name() if device != "cpu" else "cpu", "torch": torch.__version__}
    names = ("state", "owner", "alloc_site", "flags", "violation_site", "counters", "oor_value")
    ok = True
    for shape in ("token", "paged"):
        both = {mode: run_mode(probe, torch, mode, device, shape) for mode in ("driver", "c")}
        a, b = both["driver"][1], both["c"][1]
        part = {mode: both[mode][0] for mode in both}
        part["mismatched_entries"] = {n: int((getattr(a, n) != getattr(b, n)).sum()) for n in names}
        ok = ok and (
            not any(part["mismatched_entries"].values())
            and part["driver"]["error"] is None
            and part["c"]["error"] is None
            and part["driver"]["c_launches"] == 0
            and part["c"]["c_launches"] > 0
            and any(part["c"]["counters"])
        )
        out[shape] = part
    out["probe_on"] = probe.ledger_on
    out["off_reason"] = probe.off_reason
    out["ok"] = ok and probe.ledger_on
    print("RESULT " + json.dumps(out), flush=True)
    runtime.deactivate()
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
