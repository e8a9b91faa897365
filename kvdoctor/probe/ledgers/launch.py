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

Where the compiled kernel needs nothing Triton's launcher adds (no scratch memory, one CTA per
program, no cluster, cooperative or programmatic launch, no launch hooks set), it is launched
through the CUDA driver from the native path instead (`_native.launch_kernel`, launch.c):
that launcher is Python before its C call, about 10 us of the 32 a hooked call costs on an H100.
Only on Triton releases whose kernel parameters were checked that way on a GPU (`CHECKED_DIRECT`);
`KVDOCTOR_LEDGER_LAUNCH=compiled` keeps Triton's compiled launcher, `=direct` takes the driver on
an unchecked release too (to check it). A launch the driver refuses goes through Triton's launcher
instead, and this kernel stays there.

Where the driver launch is taken, the healthy alloc or free (one fused kernel, or for more than a
block its check and its write), a request-table write's owner update and a paged alloc's last_loc
check with its update (one kernel) are launched from the native fast path itself, with no Python at all
(csrc/launch.c): the Python path hands it each kernel's plan after its first launch (kernels.py).
`=driver` keeps every call on the Python path, to compare the two.
"""

from __future__ import annotations

import os
from typing import Any

from kvdoctor.probe.base.vocabulary import OP_ALLOC

I32_MAX = 2**31 - 1
# The Triton releases whose launcher this calls as their own `JITFunction.run` does, checked on a GPU
# against the torch ledger (bench/gpu/kernels_check.py). Any other takes Triton's own path.
CHECKED_TRITON = ("3.6.0",)
# The releases whose compiled kernels' parameters (the runtime arguments in order, then the two
# scratch pointers) were checked on a GPU through the driver launch, against the torch ledger.
CHECKED_DIRECT: tuple[str, ...] = ("3.6.0",)  # 2026-11-27, H200: 0 mismatches over 981 launches
# The warps a ledger kernel's program runs on. Its 512 lanes cost GPU time by how many each thread
# works through in turn, not by the few dozen a decode step's call fills: on an H100 a step's two
# kernels took 18.8 us of GPU on 1 warp, 12.0 on 2 and 9.0 on Triton's default 4; in a second run
# 8.0 on 4 and 5.35 on 16, one lane a thread (bench/gpu/run_launch.sh, reports/gpu/2026-11-28/).
# KVDOCTOR_LEDGER_WARPS (1, 2, 4, 8 or 16) sets it, to measure.
LEDGER_WARPS = int(w) if (w := os.environ.get("KVDOCTOR_LEDGER_WARPS", "16")) in ("1", "2", "4", "8", "16") else 16
# Triton's types of a runtime argument, as the driver launch packs them.
_PARAM_KINDS = {"i32": "i", "u32": "i", "i64": "l", "u64": "l"}


def _runtime_knobs() -> Any:
    if os.environ.get("KVDOCTOR_LEDGER_LAUNCH") == "triton":
        return None
    try:
        import triton
        from triton import knobs

        if triton.__version__ not in CHECKED_TRITON and os.environ.get("KVDOCTOR_LEDGER_LAUNCH") not in ("compiled", "direct"):
            return None

        knobs.runtime.launch_enter_hook  # noqa: B018 (the attribute this launcher reads on every call)
        return knobs.runtime
    except Exception:
        return None


def _driver_launch() -> Any:
    """The native path's driver launch, where this process may take it; else None."""
    mode = os.environ.get("KVDOCTOR_LEDGER_LAUNCH")
    if mode in ("triton", "compiled"):
        return None
    try:
        import triton

        from kvdoctor.probe import native

        if triton.__version__ not in CHECKED_DIRECT and mode != "direct":
            return None
        return getattr(native.NATIVE, "launch_kernel", None)
    except Exception:
        return None


def driver_plan(fn: Any, kernel: Any, runtime_args: int) -> tuple[bytes, int, int] | str:
    """How the driver launches this compiled kernel: one kind per runtime argument ('p' a pointer,
    'i' a 32-bit and 'l' a 64-bit integer), the block's threads and its shared memory. A string
    says why it cannot: something Triton's launcher would add, or a parameter not of those kinds."""
    md = kernel.metadata
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        return "a cluster, cooperative or programmatic launch"
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return "scratch memory"
    if getattr(md, "instrumentation_mode", ""):
        return "an instrumented kernel"
    signature = getattr(kernel.src, "signature", None)
    names = list(getattr(fn, "arg_names", ()))
    if not isinstance(signature, dict) or len(names) < runtime_args:
        return "no signature to read"
    kinds = []
    for name in names[:runtime_args]:
        kind = signature.get(name)
        if isinstance(kind, str) and kind.startswith("*"):
            kinds.append("p")
        elif kind in _PARAM_KINDS:
            kinds.append(_PARAM_KINDS[kind])
        else:
            return f"argument {name} is {kind!r}"
    if any(signature.get(name) != "constexpr" for name in names[runtime_args:]):
        return "a runtime argument after the constants"
    return "".join(kinds).encode(), 32 * int(md.num_warps), int(md.shared)


def _hooks_set(knobs: Any) -> bool:
    """Whether a launch hook (a profiler's) is set: Triton's launcher calls it, the driver launch cannot."""
    for hook in (knobs.launch_enter_hook, knobs.launch_exit_hook):
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return True
    return False


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
        self.fast_launches = 0  # how many calls took the native path (the benchmark reports it)
        self.driver_launches = 0  # how many of those went through the driver (launch.c)
        self.declined = ""  # why a first call's kernel could not be kept, if it could not
        self.driver = _driver_launch() if self.enabled else None
        self.plans: dict[tuple[Any, ...], tuple[bytes, int, int]] = {}
        self.driver_declined = ""  # why the driver launch was not taken, where it was not

    def __call__(self, grid: int, args: tuple[Any, ...], constants: dict[str, Any], key: tuple[Any, ...], device: int) -> None:
        """`args` are the kernel's runtime arguments in order; `constants` its constexprs, which come
        after them in every ledger kernel's signature; `key` what else selects the compiled kernel."""
        kernel = self.compiled.get(key) if self.enabled else None
        if kernel is not None:
            plan = self.plans.get(key)
            driver = self.driver
            if plan is not None and driver is not None and not _hooks_set(self.knobs):
                kinds, block, shared = plan
                values = [a.data_ptr() if k == 112 else a for a, k in zip(args, kinds, strict=True)]  # 112: 'p'
                try:
                    rc = driver(kernel.function, grid, block, shared, self.stream(device), kinds, *values)
                except Exception as exc:
                    rc = f"{type(exc).__name__}: {exc}"
                if rc == 0:
                    self.fast_launches += 1
                    self.driver_launches += 1
                    return
                self.plans.clear()  # refused (nothing was launched): Triton's launcher from now on
                self.driver = None
                self.driver_declined = f"the driver launch returned {rc}"[:200]
            # what Triton's own run does once it has found the kernel, launch hooks included
            everything = (*args, *constants.values())
            stream = self.stream(device)
            metadata = kernel.launch_metadata((grid, 1, 1), stream, *everything)
            hooks = (self.knobs.launch_enter_hook, self.knobs.launch_exit_hook)
            kernel.run(grid, 1, 1, stream, kernel.function, kernel.packed_metadata, metadata, *hooks, *everything)
            self.fast_launches += 1
            return
        kernel = self.fn[(grid,)](*args, num_warps=LEDGER_WARPS, **constants)
        if self.enabled:
            try:
                kernel.run, kernel.function, kernel.packed_metadata, kernel.launch_metadata  # noqa: B018 (what a launch reads)
                self.compiled[key] = kernel
                if self.driver is not None:
                    made = driver_plan(self.fn, kernel, len(args))
                    if isinstance(made, str):
                        self.driver_declined = made
                    else:
                        self.plans[key] = made
            except Exception as exc:  # the interpreter returns no compiled kernel: stay on Triton's path
                self.declined = f"{type(exc).__name__}: {exc}"[:200]


# DLPack's device types of the index tensors a device ledger takes (a CPU one launches only into a
# test's launch record: ledger/kernels.py's path on CPU tensors).
_DLPACK_DEVICE = {"cuda": 2, "cpu": 1}


def register_device_ledger(allocator: Any, ledger: Any) -> bool:
    """Lets the alloc and free fast paths update a GPU ledger by launching its compiled kernels
    from C (launch.c), where its kernels launch through the CUDA driver; each kernel's plan comes
    from the Python path's first launch of it (ledger/kernels.py). `KVDOCTOR_LEDGER_LAUNCH=driver`
    keeps every call on the Python path (the driver launch from there), to compare the two."""
    from kvdoctor.probe import native

    kernels = getattr(ledger, "kernels", None)
    register = getattr(native.NATIVE, "register_device_ledger", None)
    if register is None or kernels is None or not kernels.direct() or os.environ.get("KVDOCTOR_LEDGER_LAUNCH") == "driver":
        return False
    device = ledger.state.device
    device_type = _DLPACK_DEVICE.get(device.type)
    if device_type is None:
        return False
    native.ensure_torch()
    launch = kernels.fused_launch
    return bool(
        register(
            allocator,
            ledger,
            ledger.lock,
            launch.stream,
            kernels.device,
            launch.knobs,
            device_type,
            device.index or 0,
            ledger.page_size,
            kernels.block,
        )
    )


def device_plan(
    ledger: Any,
    slot: int,
    function: int,
    kinds: bytes,
    block: int,
    shared: int,
    values: tuple[Any, ...],
    at_index: int,
    at_count: int,
    at_site: int,
    at_rows: int = -1,
    at_last: int = -1,
    at_last_count: int = -1,
) -> bool:
    """One compiled kernel of a registered device ledger (False: the ledger is not registered)."""
    from kvdoctor.probe import native

    plan = getattr(native.NATIVE, "device_plan", None)
    return plan is not None and bool(
        plan(ledger, slot, function, kinds, block, shared, values, at_index, at_count, at_site, at_rows, at_last, at_last_count)
    )


def aligned(tensor: Any) -> bool:
    return bool(tensor.data_ptr() % 16 == 0)


def fits_i32(*values: int) -> bool:
    return all(-I32_MAX - 1 <= v <= I32_MAX for v in values)


# Which of a device ledger's plans (launch.c's DevicePlan slots) a call takes.


# a call of more than a block: its check's plan and its write's, by the fused plan's slot
BLOCKS_CHECK, BLOCKS_WRITE = 152, 184


def _bits(tensor: Any) -> int:
    return (2 if tensor.element_size() == 8 else 0) | (1 if aligned(tensor) else 0)  # int64 or int32


def device_slot(op: int, idx: Any, *, page_starts: bool = False, as_pages: bool = False, evicting: bool = False) -> int:
    """Which of a device ledger's compiled plans an alloc or free takes in the native fast path (launch.c,
    DEVICE_RULE_*): its rule, then the index tensor's width and alignment."""
    rule = (1 if page_starts else 0) if op == OP_ALLOC else 4 | (2 if as_pages else 0) | (1 if evicting else 0)
    return rule << 2 | _bits(idx)


def _rows_slot(base: int, idx: Any, rows: Any) -> int:
    return base + (4 + (_bits(idx) << 2 | _bits(rows)) if rows is not None else _bits(idx))


def owner_slot(idx: Any, rows: Any) -> int:
    """The owner kernel's plan in the native fast path (launch.c, DEVICE_OWNER_SLOT): one row, or a
    tensor of rows, then the slots' (and the rows') width and alignment."""
    return _rows_slot(32, idx, rows)


def last_loc_slot(idx: Any, rows: Any) -> int:
    """The last_loc check's plan (DEVICE_LAST_LOC_SLOT): with or without the rows it was read for."""
    return _rows_slot(52, idx, rows)


def last_loc_alloc_slot(last: Any, rows: Any, idx: Any) -> int:
    """The check fused with a paged alloc's update (DEVICE_LAST_LOC_ALLOC_SLOT): the check's, then
    the allocated slots' width and alignment."""
    return 72 + ((_rows_slot(0, last, rows) << 2) | _bits(idx))
