"""The GPU ledger's native fast path (csrc/launch.c, device_update) against its Python path, on SGLang's
real `TokenToKVPoolAllocator`, with no GPU: what each path would hand the CUDA driver is recorded
instead of launched, and compared call by call.

The ledger is the GPU one (torch arrays, the Triton kernels' path) on CPU tensors. What needs a GPU
is stood in for, only that: `kernel[grid]`'s first call per compiled kernel compiles it for an
H100 with the installed Triton (the parameters the driver launch packs are that kernel's own) and
returns it with a made-up handle; the driver launch is a recorder on both paths (Python's
`CompiledLaunch.driver`, C's `launch_record`); the current stream is a fixed handle. The ledger's
values do not change (no kernel runs): the comparison is of launches, every parameter of them.

Prints `RESULT {json}`: per step, which path launched what, and the Python path's launch for the
same call.
"""

from __future__ import annotations

import json
import os
import sys
import types
import warnings

warnings.filterwarnings("ignore")
os.environ["KVDOCTOR_LEDGER_KERNELS"] = "1"  # the kernels' path on a torch ledger, though on CPU tensors
os.environ["KVDOCTOR_LEDGER_LAUNCH"] = "direct"  # the driver launch on the installed Triton too

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvdoctor.probe.ledgers import arrays, kernels, launch, slots  # noqa: E402

STREAM = 0x5000
FIRST: list = []  # first calls per compiled kernel (through `kernel[grid]`, the Python path)
PY: list = []  # the Python path's driver launches
C: list = []  # the native fast path's
TRITON: list = []  # launches through Triton's own launcher (a launch hook set)
_TYPES = {torch.int64: "*i64", torch.int32: "*i32", torch.int8: "*i8"}


class CompileOnly:
    """`kernel[grid](*args, **constants)` where no GPU is: the kernel compiled for an H100 by the
    installed Triton, returned with a made-up handle; nothing runs."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.arg_names = fn.arg_names

    def __getitem__(self, grid):
        def first_call(*args, num_warps=4, **constants):
            names = self.fn.arg_names
            signature = {}
            for name, arg in zip(names, [*args, *constants.values()], strict=True):
                signature[name] = "constexpr" if name in constants else _TYPES[arg.dtype] if hasattr(arg, "dtype") else "i32"
            src = ASTSource(fn=self.fn, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
            handle = 0x1000 + 0x10 * len(FIRST)
            FIRST.append({"function": handle, "grid": grid[0], "n": int(args[1])})

            def run(*a):
                TRITON.append({"function": a[4], "grid": a[0]})

            return types.SimpleNamespace(
                function=handle,
                metadata=compiled.metadata,
                src=compiled.src,
                packed_metadata=None,
                launch_metadata=lambda *a: None,
                run=run,
            )

        return first_call


def recorder(function, grid, block, shared, stream, kinds, *values):
    PY.append([function, grid, block, shared, stream, list(values)])
    return 0


original_init = kernels.LedgerKernels.__init__


def stood_in(self, ledger) -> None:
    original_init(self, ledger)
    for one in self.launchers():
        one.fn = CompileOnly(one.fn)
        if one.driver is not None:
            one.driver = recorder


kernels.LedgerKernels.__init__ = stood_in
slots.arrays_for = lambda device: arrays.DeviceArrays("cpu")
launch._raw_stream = lambda: lambda device: STREAM + device


def gpu_table_writes() -> None:
    """The request pool's table is on the CPU here: its rows' extents, which the probe keeps for a
    host table only, are not kept, as for a GPU table."""
    from kvdoctor.probe.engines.sglang import state

    state.SglangState.note_row_write = lambda self, pool, rows, columns, values: None


def main() -> int:
    trace = sys.argv[1]
    from kvdoctor.probe import native
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang.state import sglang_state

    probe = runtime.activate(trace)
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    native.NATIVE.launch_record(C)
    allocator = TokenToKVPoolAllocator(4096, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
    if sys.argv[2:] == ["write-failure"]:
        return write_failure(probe, allocator)
    steps = []

    def step(name, call):
        before = (len(FIRST), len(PY), len(C), len(TRITON))
        out = call()
        steps.append(
            {"name": name, "first": FIRST[before[0] :], "python": PY[before[1] :], "c": C[before[2] :], "triton": TRITON[before[3] :]}
        )
        return out

    def python_path_of(last_c, index, op, **rule):
        """The Python ledger path's launch for the same call (its kernels, its driver launch)."""
        ledger = sglang_state(probe).ledger_for(allocator)
        site = last_c[5][-1]
        mark = len(PY)
        if op == "alloc":
            ledger.kernels.alloc(ledger.kernels.index(index), site, False)
        else:
            ledger.kernels.free(ledger.kernels.index(index), site, rule.get("evicting", False), False)
        return PY[mark:]

    a = step("alloc 8, first", lambda: allocator.alloc(8))
    b = step("alloc 8", lambda: allocator.alloc(8))
    steps[-1]["python_same_call"] = python_path_of(steps[-1]["c"][0], b, "alloc") if steps[-1]["c"] else []
    step("free 8, first", lambda: allocator.free(a))
    c = step("alloc 16", lambda: allocator.alloc(16))
    step("free 8", lambda: allocator.free(b))
    steps[-1]["python_same_call"] = python_path_of(steps[-1]["c"][0], b, "free") if steps[-1]["c"] else []
    wide = c.clone()
    step("free int32, first", lambda: allocator.free(wide[:8].to(torch.int32)))
    narrow = wide[8:].to(torch.int32)
    step("free int32", lambda: allocator.free(narrow))
    steps[-1]["python_same_call"] = python_path_of(steps[-1]["c"][0], narrow, "free") if steps[-1]["c"] else []
    d = step("alloc 8 again", lambda: allocator.alloc(8))
    step("free unaligned, first", lambda: allocator.free(d[1:4]))
    tail = d[5:8]
    step("free unaligned", lambda: allocator.free(tail))
    steps[-1]["python_same_call"] = python_path_of(steps[-1]["c"][0], tail, "free") if steps[-1]["c"] else []
    step("free empty", lambda: allocator.free(d[:0]))
    big = step("alloc 600 (more than a block)", lambda: allocator.alloc(600))
    step("free 600", lambda: allocator.free(big))
    big = step("alloc 600 again", lambda: allocator.alloc(600))
    steps[-1]["python_same_call"] = python_path_of(steps[-1]["c"][0], big, "alloc") if steps[-1]["c"] else []
    step("free 600 again", lambda: allocator.free(big))
    steps[-1]["python_same_call"] = python_path_of(steps[-1]["c"][0], big, "free") if steps[-1]["c"] else []
    from triton import knobs

    hook = lambda *a: None
    knobs.runtime.launch_enter_hook.add(hook)
    e = step("alloc 8, a launch hook set", lambda: allocator.alloc(8))
    e = e.clone()
    knobs.runtime.launch_enter_hook.remove(hook)
    sites = {s["name"]: probe.sites.name(s["c"][0][5][-1]) for s in steps if s["c"]}
    request_table_writes(probe, allocator, step, steps)
    paged_last_loc(probe, step, steps)
    stats = native.NATIVE.stats()
    ledger = sglang_state(probe).ledger_for(allocator)
    pointers = {"state": ledger.state.data_ptr(), "owner": ledger.owner.data_ptr(), "alloc_site": ledger.alloc_site.data_ptr()}
    available = allocator.available_size()
    native.NATIVE.fail_after(native.KINDS["free"])
    step("free 8, failing after the host's call", lambda: allocator.free(e))
    native.NATIVE.fail_after(-1)
    native.NATIVE.launch_record(None)
    result = {
        "steps": steps,
        "owner_first_handles": [f["function"] for s in steps if s["name"].startswith("write") for f in s["first"]],
        "sites": sites,
        "device_launches": stats["device_launches"],
        "pointers": pointers,
        "freed_by_the_host": allocator.available_size() - available,
        "probe_on_after_failure": probe.ledger_on,
        "off_reason": probe.off_reason,
    }
    runtime.deactivate()
    print("RESULT " + json.dumps(result))
    return 0


def request_table_writes(probe, allocator, step, steps) -> None:
    """SGLang's `ReqToTokenPool.write`: one row (a prefill's) and a row per slot (a decode step's
    batched write), each first through Python, then from C; beside each later call, the Python
    path's owner launch for the same call."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvdoctor.probe.engines.sglang.state import sglang_state

    gpu_table_writes()
    pool = ReqToTokenPool(8, 1024, "cpu", False)

    def python_path_of(values, rows):
        ledger = sglang_state(probe).ledger_for(allocator)
        mark = len(PY)
        ledger.kernels.owner(ledger.kernels.index(values), rows if isinstance(rows, int) else ledger.kernels.index(rows))
        steps[-1]["python_same_call"] = PY[mark:]

    first, later = (step("alloc for a write", lambda: allocator.alloc(8)).clone() for _ in range(2))
    step("write one row, first", lambda: pool.write((0, slice(0, 8)), first))
    step("write one row", lambda: pool.write((1, slice(0, 8)), later))
    python_path_of(later, 1)
    rows = torch.tensor([2, 3, 4, 5], dtype=torch.int64)
    columns = torch.tensor([7, 7, 9, 9], dtype=torch.int64)
    a, b = (step("alloc for a write", lambda: allocator.alloc(4)).to(torch.int32) for _ in range(2))
    step("write rows, first", lambda: pool.write((rows, columns), a))
    moved = rows + 1
    step("write rows", lambda: pool.write((moved, columns), b))
    python_path_of(b, moved)
    narrow = rows.to(torch.int32)
    step("write int32 rows, first", lambda: pool.write((narrow, columns), a))
    step("write int32 rows", lambda: pool.write((narrow, columns), b))
    python_path_of(b, narrow)
    big = step("alloc for a write", lambda: allocator.alloc(600)).clone()
    step("write one row of 600 slots", lambda: pool.write((6, slice(0, 600)), big))
    python_path_of(big, 6)
    # one row's tensor broadcast over three columns: the Python role names no owner then, nor does C
    step("write rows of another length", lambda: pool.write((rows[:1], columns[:3]), b[:3]))


def paged_last_loc(probe, step, steps) -> None:
    """SGLang's paged `alloc_extend` and `alloc_decode` with the `last_loc` they are given: its check
    (with the rows `get_last_loc` read it for, where it did) and the alloc's update in one launch
    after the host's call, from C once the Python path has launched that kernel once; with no
    slots to update (no room), the check alone."""
    from sglang.srt.mem_cache import allocation
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    from kvdoctor.probe.engines.sglang.state import sglang_state

    paged = PagedTokenToKVPoolAllocator(4096, 4, torch.float16, "cpu", None, False)
    table = torch.zeros((4, 64), dtype=torch.int32)

    def python_path_of(last, rows, out):
        kernels = sglang_state(probe).ledger_for(paged).kernels
        site = steps[-1]["c"][0][5][-1] if steps[-1]["c"] else 0
        mark = len(PY)
        rows = None if rows is None else kernels.index(rows)
        if out is None:
            kernels.last_loc(kernels.index(last), site, rows)
        else:
            kernels.last_loc_alloc(kernels.index(last), site, rows, kernels.index(out), True)
        steps[-1]["python_same_call"] = PY[mark:]

    def extend(prefix, seq, last):
        n = sum(seq) - sum(prefix)
        as_tensor = torch.tensor
        return paged.alloc_extend(as_tensor(prefix), as_tensor(prefix), as_tensor(seq), as_tensor(seq), last, n)

    def decode(rows, seq):
        last = allocation.get_last_loc_torch(table, rows, torch.tensor(seq) - 1)  # remembers the rows it read
        return last, paged.alloc_decode(torch.tensor(seq), torch.tensor(seq), last)

    out = step("extend, first", lambda: extend([0, 0], [5, 6], torch.tensor([-1, -1])))
    table[0, :5], table[1, :6] = out[:5].to(torch.int32), out[5:].to(torch.int32)
    rows = torch.tensor([0, 1])
    step("decode with rows, first", lambda: decode(rows, [6, 7]))
    last, out = step("decode with rows", lambda: decode(rows, [6, 7]))
    python_path_of(last, rows, out)
    given = torch.tensor([int(out[0]), int(out[1])])
    step("extend, last_loc given, first", lambda: extend([6, 6], [9, 8], given))
    out = step("extend, last_loc given", lambda: extend([6, 6], [9, 8], given))
    python_path_of(given, None, out)
    minus_one = torch.tensor([-1])
    none = step("extend, no room", lambda: extend([0], [5000], minus_one))
    assert none is None
    python_path_of(minus_one, None, None)


def write_failure(probe, allocator) -> int:
    """A failure in the native path of a request-table write, after the host's own write."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from kvdoctor.probe import native
    from kvdoctor.probe.core import runtime

    gpu_table_writes()
    pool = ReqToTokenPool(8, 64, "cpu", False)
    first, later = allocator.alloc(8).clone(), allocator.alloc(8).clone()
    pool.write((0, slice(0, 8)), first)  # the owner kernel's first call: the Python path
    native.NATIVE.fail_after(native.KINDS["req_write"])
    launched = len(C)
    pool.write((1, slice(0, 8)), later)
    native.NATIVE.fail_after(-1)
    native.NATIVE.launch_record(None)
    result = {
        "c_launches": len(C) - launched,
        "row_written": pool.req_to_token[1, :8].tolist() == later.tolist(),
        "probe_on_after_failure": probe.ledger_on,
        "off_reason": probe.off_reason,
    }
    runtime.deactivate()
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
