"""On the GPU machine: the native path's tensor readers (in place, DLPack, torch's getters) on
the tensors a GPU server hands the probe. CPU and pinned host index tensors must read alike by
every reader; CUDA and meta tensors must be left by the in-place reader to DLPack (which declines
device memory). Prints one JSON line; exit 1 on any disagreement.

    gcc -O2 -std=c11 -fvisibility=hidden -shared -fPIC $(python3-config --includes) kvdoctor/probe/native/csrc/*.c \
        -o kvdoctor/probe/native/_native$(python3-config --extension-suffix)
    PYTHONPATH=. python3 tests/gpu/harness/readers_check.py
"""

from __future__ import annotations

import json
import sys

import torch

from kvdoctor.probe import native


def main() -> int:
    ext = native.NATIVE
    if ext is None:
        print(json.dumps({"error": "the native path is not built"}))
        return 1
    native.ensure_torch()
    stats = ext.stats()
    base = torch.arange(64, dtype=torch.int64)
    cpu = native.index_samples(torch) + [base[3:40], base.view(8, 8)[2], base.to(torch.int32)[5:9]]
    pinned = [base.pin_memory(), base.pin_memory()[7:19], base.to(torch.int32).pin_memory()[1:], base.pin_memory().view(8, 8)]
    cuda = [base.cuda(), base.cuda()[5:9], base.to(torch.int32).cuda(), base.cuda().view(8, 8)[1]]
    rows = []
    ok = True
    for kind, tensors, in_place_expected in (("cpu", cpu, None), ("pinned", pinned, True), ("cuda", cuda, False)):
        for t in tensors:
            agree = bool(ext.readers_agree(t))
            in_place = bool(ext.read_in_place(t))
            expected = in_place_expected if in_place_expected is not None else None
            good = agree and (expected is None or not stats["direct_reader"] or in_place == expected)
            ok &= good
            rows.append({"kind": kind, "shape": list(t.shape), "dtype": str(t.dtype), "agree": agree, "in_place": in_place, "good": good})
    torch.cuda.synchronize()
    out = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "dlpack_reader": stats["dlpack_reader"],
        "direct_reader": stats["direct_reader"],
        "all_good": ok,
        "tensors": rows,
    }
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
