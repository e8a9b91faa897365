"""On the GPU: what one launch from the native fast path is made of, each part timed alone in a loop
(the queue drained every 256 calls): the current stream's handle as the native path asks torch for it,
a bare driver launch of a one-program Triton kernel through `_native.launch_kernel` (a Python call
around `cuLaunchKernel`), and torch's smallest kernel (`tensor.add_(1)`) for comparison. Medians in
microseconds; RESULT {json}.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def timed(fn, n: int, drain) -> float:
    clock = time.perf_counter
    out = []
    for i in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e6)
        if i % 256 == 255:
            drain()
    return round(statistics.median(out[n // 10 :]), 3)


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    import torch
    import triton
    import triton.language as tl

    from kvdoctor.probe import native

    @triton.jit
    def one(x_ptr, n):
        offs = tl.arange(0, 128)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0) + 1, mask=offs < n)

    x = torch.zeros(128, dtype=torch.int32, device="cuda")
    compiled = one[(1,)](x, 32)
    torch.cuda.synchronize()
    stream_of = torch._C._cuda_getCurrentRawStream
    stream = stream_of(0)
    launch = native.NATIVE.launch_kernel
    function, block, shared = compiled.function, 32 * compiled.metadata.num_warps, compiled.metadata.shared
    ptr = x.data_ptr()
    sync = torch.cuda.synchronize
    out = {
        "gpu": torch.cuda.get_device_name(),
        "stream_handle_us": timed(lambda: stream_of(0), n, sync),
        "driver_launch_us": timed(lambda: launch(function, 1, block, shared, stream, b"pi", ptr, 32), n, sync),
        "torch_add_us": timed(lambda: x.add_(1), n, sync),
        "nothing_us": timed(lambda: None, n, sync),
    }
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
