"""A child process that grows (or churns) one memory class in large steps, with the probe on.

    python memory_class_cases.py CASE STEP_MIB STEPS INTERVAL_S

CASE is `native` (anonymous pages from mmap, touched, never unmapped: neither Python nor malloc
accounts for them), `malloc` (malloc + memset, never freed), `python` (a chain of small Python
objects: CPython's own small-object arenas), `flat` (each step makes as much of all three and
gives it back) or `torch-str-op`: vllm#50150 as it happens, an eager custom op registered through
torch's stable ABI with a `str` argument (as vLLM's `reshape_and_cache_flash` takes
`kv_cache_dtype`), built here against the torch this Python imports and called STEP_MIB thousand
times a step. torch before 2.14 unboxes that `str` into a `new std::string` it never deletes
(pytorch#191340): 48 bytes of malloc heap per call. Without a C++ compiler it exits with
SKIP_EXIT_CODE. The probe is turned on the way an engine import would under `kvdoctor run`, and
the process exits right after its last step (without freeing what it kept, which on a busy
machine takes long enough to look like a plateau from outside), so the leak is still growing
when the trace ends.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvdoctor.probe.core import runtime

MIB = 1 << 20
PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
PYTHON_LINK_BYTES = 160  # a 2-tuple and a 40-byte bytes object, each in a pymalloc block
SKIP_EXIT_CODE = 3
KV_CACHE_DTYPE = "fp8_e4m3"  # one of vLLM's kv_cache_dtype values: short, so the leak is 48 B a call

# The shape of vLLM's stable cache ops: tensors and a `str kv_cache_dtype`, registered with
# STABLE_TORCH_LIBRARY and boxed by TORCH_BOX, so every eager call unboxes the string.
STR_OP_SOURCE = r"""
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <cstdint>
#include <string>

int64_t cache_dtype_code(torch::stable::Tensor key, std::string kv_cache_dtype) {
  return kv_cache_dtype == "auto" ? 0 : static_cast<int64_t>(kv_cache_dtype.size());
}

STABLE_TORCH_LIBRARY(kvdoctor_cases, m) {
  m.def("cache_dtype_code(Tensor key, str kv_cache_dtype) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(kvdoctor_cases, CPU, m) {
  m.impl("cache_dtype_code", TORCH_BOX(&cache_dtype_code));
}
"""

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]


def native_pages(size: int) -> int:
    address = libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    ctypes.memset(address, 1, size)
    return int(address)


def malloced(size: int) -> int:
    address = libc.malloc(size)
    if not address:
        raise MemoryError(size)
    ctypes.memset(address, 1, size)
    return int(address)


def python_chain(size: int, head: object = None) -> object:
    for _ in range(size // PYTHON_LINK_BYTES):
        head = (head, bytes(40))
    return head


HELD: list[int] = []  # module globals: what leaked stays until the probe's exit reading is written
CHAIN: list[object] = [None]


def churn(size: int) -> None:
    """Makes as much of each class as one step and gives it back."""
    libc.munmap(native_pages(size), size)
    libc.free(malloced(size))
    python_chain(size)


def str_op() -> Any:
    """The op above, compiled against this Python's torch and loaded (None without a compiler)."""
    import torch

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    build = tempfile.mkdtemp(prefix="kvdoctor-str-op-")
    source, library = os.path.join(build, "op.cpp"), os.path.join(build, "op.so")
    with open(source, "w") as fh:
        fh.write(STR_OP_SOURCE)
    include, lib = os.path.join(torch_dir, "include"), os.path.join(torch_dir, "lib")
    subprocess.run(
        [compiler, "-O1", "-std=c++17", "-shared", "-fPIC", f"-I{include}", source, f"-L{lib}", "-ltorch_cpu", "-lc10", "-o", library],
        check=True,
        capture_output=True,
    )
    torch.ops.load_library(library)
    shutil.rmtree(build, ignore_errors=True)
    key = torch.zeros(8)
    op = torch.ops.kvdoctor_cases.cache_dtype_code

    def call(calls: int) -> None:
        for _ in range(calls):
            op(key, KV_CACHE_DTYPE)

    return call


def main() -> None:
    case, step_mib, steps, interval_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    if case not in ("native", "malloc", "python", "flat", "torch-str-op"):
        raise SystemExit(f"unknown case {case!r}")
    size = step_mib * MIB
    call_op = None
    if case == "torch-str-op":
        call_op = str_op()
        if call_op is None:
            print("SKIP no C++ compiler to build the op", flush=True)
            raise SystemExit(SKIP_EXIT_CODE)
        call_op(step_mib * 1000)
    else:
        churn(size)  # every case starts warm: the allocators' first growth is behind it
    runtime.activate()
    torch = sys.modules.get("torch")
    print("ready", f"torch {torch.__version__}" if torch is not None else "", flush=True)
    time.sleep(interval_s * 4)  # a few flat readings before the first step
    for _ in range(steps):
        if call_op is not None:
            call_op(step_mib * 1000)
        elif case == "native":
            HELD.append(native_pages(size))
        elif case == "malloc":
            HELD.append(malloced(size))
        elif case == "python":
            CHAIN[0] = python_chain(size, CHAIN[0])
        else:
            churn(size)
        time.sleep(interval_s)
    print("done", flush=True)
    runtime.deactivate()  # the trace is complete: leave at once, not after freeing what was kept
    os._exit(0)


if __name__ == "__main__":
    main()
