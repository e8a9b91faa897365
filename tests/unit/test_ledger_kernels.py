"""The GPU ledger's Triton kernels agree with the torch path, op for op.

On a GPU the ledger runs as two Triton kernels per hooked call; here the same kernels run under
Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, against the torch path, over random
sequences of allocations, frees (slots and pages, inside and outside evictions), tree inserts,
owner writes, last_loc checks and paged allocations with their last_loc (one kernel on the
kernels' path), including double frees, stale last_locs and out-of-range indices."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPT = r"""
import json, os, random, sys
import torch
from kvdoctor.probe.ledgers import arrays
from kvdoctor.probe.ledgers import slots as L

def make(kernels, size, ps):
    led = L.SlotLedger(name="t", size=size, page_size=ps, device="cpu", emit=lambda n, a: None,
                       requests=L.RequestTable(), sites=L.CallSites(), xp=arrays.DeviceArrays("cpu"))
    if kernels:
        assert led.use_kernels()
    return led

out, fused = [], [0]

class Counted:  # the fused last_loc kernel, its launches counted (the sequences must reach it)
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        fused[0] += 1
        return self.fn[grid]

for seed in range(int(sys.argv[1])):
    rng = random.Random(seed)
    ps = rng.choice([1, 4])
    size = 64 * ps
    a, b = make(False, size, ps), make(True, size, ps)
    b.kernels.last_loc_alloc_launch.fn = Counted(b.kernels.last_loc_alloc_launch.fn)
    written = None
    for step in range(60):
        op = rng.choice(["alloc", "free", "freepages", "tree", "owner", "lastloc", "evict", "lastlocalloc"])
        n = rng.randint(1, 12)
        rows = size + ps
        idx = torch.tensor([rng.randrange(-3, rows + 3) if rng.random() < 0.1 else rng.randrange(0, rows) for _ in range(2 * n)],
                           dtype=rng.choice([torch.int64, torch.int32]))
        idx = idx[::2] if rng.random() < 0.3 else idx[:n]  # every other element: a strided view
        site = rng.randrange(1, 50)
        for led in (a, b):
            if op == "alloc":
                led.on_alloc(idx, site, only_page_starts=(step % 2 == 0))
            elif op == "free":
                led.on_free(idx, site, evicting=False)
            elif op == "evict":
                led.on_free(idx, site, evicting=True)
            elif op == "freepages":
                led.on_free(idx // ps, site, evicting=False, as_pages=True)
            elif op == "tree":
                led.on_tree_insert(idx, site)
            elif op == "owner":
                led.on_owner(idx, 7)
                written = idx
            elif op == "lastloc":
                led.check_last_loc(idx, site, torch.full_like(idx, 3))
            else:  # a paged alloc's last_loc, with the rows it was read for or without, then its slots
                # slots a row was written to last (owned by request 7, so rows of 3 make them stale), or these
                last = written[: max(1, n // 3)] if written is not None and site % 3 else idx.flip(0)[: max(1, n // 3)]
                led.on_last_loc_alloc(last, torch.full_like(last, 3) if site % 2 else None, idx, site, True)
    same = {k: bool(torch.equal(getattr(a, k), getattr(b, k))) for k in ("state", "owner", "flags", "violation_site", "counters")}
    same["alloc_site"] = bool(torch.equal(a.alloc_site[:-1], b.alloc_site[:-1]))  # the sink row is scratch
    out.append({"seed": seed, "same": same, "counters": b.counters.tolist()})
print("RESULT " + json.dumps({"seeds": out, "fused_launches": fused[0]}))
"""


def test_triton_kernels_match_the_torch_path():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "12"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    result = json.loads(line[-1][7:])
    for r in result["seeds"]:
        assert all(r["same"].values()), r
    assert sum(sum(r["counters"]) for r in result["seeds"]) > 0  # the sequences did break rules
    assert result["fused_launches"] > 0  # and reached the fused last_loc kernel


def test_each_kernels_constants_come_in_its_own_order():
    """A compiled launch passes the constants by position after the runtime arguments, so each
    call's cached constants must list them exactly as the kernel's signature does."""
    pytest.importorskip("triton")
    from kvdoctor.probe.ledgers import kernels
    from kvdoctor.trace import schema

    bound = kernels.LedgerKernels.__new__(kernels.LedgerKernels)
    bound.slot, bound.bits, bound._constants = kernels.KIND_SLOT, kernels.KIND_BITS, {}
    for name, fn in (("check", kernels._check), ("write", kernels._write), ("fused", kernels._check_write)):
        params = list(fn.arg_names)
        constexprs = [p for p in params if p.isupper()]
        assert params[-len(constexprs) :] == constexprs  # the constants come last
        for has_req in (False, True):
            constants = bound._rule(name, 1, schema.DOUBLE_FREE, has_req=has_req)
            assert list(constants) == constexprs, name
    params = list(kernels._last_loc_check_write.arg_names)
    constexprs = [p for p in params if p.isupper()]
    assert params[-len(constexprs) :] == constexprs
    for has_req in (False, True):
        assert list(bound._last_loc_alloc_rule(has_req)) == constexprs
