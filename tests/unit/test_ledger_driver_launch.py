"""The driver launch of the GPU ledger's kernels (probe/ledgers/launch.py, csrc/launch.c) packs exactly the
parameters Triton's compiler gives each kernel.

The driver reads a kernel's parameters from the pointers it is handed, as many as the kernel
declares and of the sizes it declares: a pointer where the kernel takes a 32-bit integer shifts
every parameter after it. So each ledger kernel is compiled here by the installed Triton for an
H100 (no GPU is needed to compile), and the plan `driver_plan` makes from the compiled kernel is
held against the kernel's own PTX entry: one 64-bit pointer per 'p', one 32-bit integer per 'i',
then the two scratch pointers launch.c appends. The GPU check (tests/gpu/harness/kernels_check.py) then
runs the same launches against the torch ledger.
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvdoctor.probe import native  # noqa: E402
from kvdoctor.probe.ledgers import kernels  # noqa: E402
from kvdoctor.probe.ledgers.launch import driver_plan  # noqa: E402

# each kernel with constants of one real call (LedgerKernels._rule / .owner build them the same way)
RULE = dict(OP=1, PAGE_STARTS=False, AS_PAGES=False, WEIGHT=1, KIND_SLOT=0, KIND_BIT=1, OOR_SLOT=2, OOR_BIT=4)
CASES = {
    "check": (kernels._check, {**RULE, "HAS_REQ": True}),
    "write": (kernels._write, {"OP": 1, "PAGE_STARTS": False, "AS_PAGES": False, "EVICTING": False}),
    "check_write": (kernels._check_write, {**RULE, "EVICTING": False}),
    "owner": (kernels._owner, {"REQ_TENSOR": True}),
}
PARAM = re.compile(r"\.param \.(\w+)( \.ptr)?")


def compiled(fn, constants, index_dtype):
    names = fn.arg_names
    constants = {**constants, "BLOCK": kernels.BLOCK}
    signature = {
        n: "constexpr" if n in constants else (f"*{index_dtype}" if n == "idx_ptr" else "*i32") if n.endswith("_ptr") else "i32"
        for n in names
    }
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)), len(names) - len(constants)


def ptx_params(kernel):
    ptx = kernel.asm["ptx"]
    entry = ptx[ptx.index(".entry") :]
    entry = entry[: entry.index(")")]
    return [
        ("p" if ptr else {"u32": "i", "b32": "i", "s32": "i", "u64": "l", "b64": "l", "s64": "l"}.get(t, t))
        for t, ptr in PARAM.findall(entry)
    ]


@pytest.mark.parametrize("index_dtype", ["i32", "i64"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_is_the_kernels_own_parameter_list(name, index_dtype):
    fn, constants = CASES[name]
    kernel, runtime_args = compiled(fn, constants, index_dtype)
    plan = driver_plan(fn, kernel, runtime_args)
    assert not isinstance(plan, str), plan
    kinds, block, shared = plan
    assert ptx_params(kernel) == [*kinds.decode(), "p", "p"]  # the two scratch pointers launch.c passes
    assert block == 32 * kernel.metadata.num_warps and shared == kernel.metadata.shared


def test_a_kernel_with_scratch_memory_or_a_wider_integer_keeps_tritons_launcher():
    fn, constants = CASES["check_write"]
    kernel, runtime_args = compiled(fn, constants, "i32")
    assert driver_plan(fn, kernel, runtime_args - 1) == "a runtime argument after the constants"
    kernel.metadata = kernel.metadata._replace(global_scratch_size=64)
    assert driver_plan(fn, kernel, runtime_args) == "scratch memory"


@pytest.mark.skipif(native.NATIVE is None, reason="the native path is not built")
def test_the_driver_launch_refuses_what_it_cannot_pack_without_launching():
    launch = native.NATIVE.launch_kernel
    with pytest.raises(TypeError):
        launch(0, 1, 128, 0, 0, b"pi", 1)  # one kind too many
    with pytest.raises(TypeError):
        launch(0, 1, 128, 0, 0, b"f", 1.0)
    with pytest.raises(OverflowError):
        launch(0, 1, 128, 0, 0, b"i", 2**31)
    assert launch(0, 0, 128, 0, 0, b"") == 0  # an empty grid launches nothing, as Triton's launcher
