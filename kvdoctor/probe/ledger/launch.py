"""Launches the ledger's compiled Triton kernels straight through their own C launcher.

`kernel[grid](...)` binds the arguments, works out their specialisation and looks the compiled
kernel up on every call: tens of microseconds of the scheduler thread's time per launch, and a
hooked call launches two. The ledger's kernels take their integers unspecialised
(`do_not_specialize`), so what selects a compiled kernel is only what this cache keys on: the
compile-time constants, the index tensors' dtypes and whether they are 16-byte aligned, and the
device. The first call of a key goes through Triton as before (and compiles); every later one
calls the compiled kernel's launcher with the same arguments, launch hooks included, that Triton's
own `run` passes it once it has found the kernel.

Whatever it does not know takes Triton's path, as before: the interpreter (`TRITON_INTERPRET`), a
Triton release not checked against the torch ledger on a
GPU (`CHECKED_TRITON`), an integer past 32 bits. `KVDOCTOR_LEDGER_LAUNCH=triton` always takes Triton's
path; `=compiled` takes this one on an unchecked release too (to check it).
"""

from __future__ import annotations

import os
from typing import Any

I32_MAX = 2**31 - 1
# The Triton releases whose launcher this calls as their own `JITFunction.run` does, checked on a GPU
# against the torch ledger (bench/gpu/kernels_check.py). Any other takes Triton's own path.
CHECKED_TRITON = ("3.6.0",)


def _runtime_knobs() -> Any:
    if os.environ.get("KVDOCTOR_LEDGER_LAUNCH") == "triton":
        return None
    try:
        import triton
        from triton import knobs

        if triton.__version__ not in CHECKED_TRITON and os.environ.get("KVDOCTOR_LEDGER_LAUNCH") != "compiled":
            return None

        knobs.runtime.launch_enter_hook  # noqa: B018 (the attribute this launcher reads on every call)
        return knobs.runtime
    except Exception:
        return None


def _raw_stream() -> Any:
    """The current CUDA stream's handle for a device index, as Triton's own driver reads it."""
    try:
        import torch

        return torch._C._cuda_getCurrentRawStream
    except Exception:
        return None


class CompiledLaunch:
    """One Triton kernel of the ledger, launched through its compiled form once it has one."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.knobs = _runtime_knobs()
        self.stream = _raw_stream()
        self.enabled = self.knobs is not None and self.stream is not None
        self.compiled: dict[tuple[Any, ...], Any] = {}
        self.fast_launches = 0  # how many calls took the compiled path (the benchmark reports it)
        self.declined = ""  # why a first call's kernel could not be kept, if it could not

    def __call__(self, grid: int, args: tuple[Any, ...], constants: dict[str, Any], key: tuple[Any, ...], device: int) -> None:
        """`args` are the kernel's runtime arguments in order; `constants` its constexprs, which come
        after them in every ledger kernel's signature; `key` what else selects the compiled kernel."""
        kernel = self.compiled.get(key) if self.enabled else None
        if kernel is not None:
            # what Triton's own run does once it has found the kernel, launch hooks included
            everything = (*args, *constants.values())
            stream = self.stream(device)
            metadata = kernel.launch_metadata((grid, 1, 1), stream, *everything)
            hooks = (self.knobs.launch_enter_hook, self.knobs.launch_exit_hook)
            kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, metadata, *hooks, *everything)
            self.fast_launches += 1
            return
        kernel = self.fn[(grid,)](*args, **constants)
        if self.enabled:
            try:
                kernel.run, kernel.function, kernel.packed_metadata, kernel.launch_metadata  # noqa: B018 (what a launch reads)
                self.compiled[key] = kernel
            except Exception as exc:  # the interpreter returns no compiled kernel: stay on Triton's path
                self.declined = f"{type(exc).__name__}: {exc}"[:200]


def aligned(tensor: Any) -> bool:
    return bool(tensor.data_ptr() % 16 == 0)


def fits_i32(*values: int) -> bool:
    return all(-I32_MAX - 1 <= v <= I32_MAX for v in values)
