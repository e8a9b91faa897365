"""The slot ledger's GPU path as two Triton kernels per hooked call instead of ~40 torch ops.

Each ledger rule is elementwise over the call's indices, so it fits one kernel: `_check` reads the
state every index had before the call and records violations (atomic counters, per-page bits and
call site, the worst out-of-range value); `_write` then applies the state change. Two launches,
because a free of a paged request lists every token of a page and a kernel of several programs would
see its own writes; a call of at most BLOCK indices runs both in one program (`_check_write`), with
a barrier between the reads and the writes. Every transition is idempotent for repeated indices of
one call, so `_write` needs no ordering. Nothing is read back to the host. After a kernel's first call its compiled form is launched
directly (`launch.py`): Triton's Python launcher cost more host time than the ledger's work. A paged
alloc's last_loc check and its own update share one program where both fit (`_last_loc_check_write`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvdoctor.probe.base import vocabulary
from kvdoctor.probe.base.vocabulary import KIND_BITS, KIND_SLOT, OP_ALLOC, OP_FREE, OP_LAST_LOC, OP_TREE_INSERT
from kvdoctor.probe.ledgers import launch as plan_slots
from kvdoctor.probe.ledgers.launch import CompiledLaunch, aligned, device_plan, fits_i32
from kvdoctor.trace import schema

# The kernels read the shared state bits and op codes as compile-time constants.
FREE: tl.constexpr = tl.constexpr(vocabulary.FREE)
OWNED: tl.constexpr = tl.constexpr(vocabulary.OWNED)
TREE: tl.constexpr = tl.constexpr(vocabulary.TREE)
HELD: tl.constexpr = tl.constexpr(vocabulary.OWNED | vocabulary.TREE)
ALLOC: tl.constexpr = tl.constexpr(OP_ALLOC)
FREEING: tl.constexpr = tl.constexpr(OP_FREE)
LAST_LOC: tl.constexpr = tl.constexpr(OP_LAST_LOC)
BLOCK = 512
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _pages(v, m, rows, page_size, num_pages, sink, AS_PAGES: tl.constexpr, ALLOW_MINUS_ONE: tl.constexpr):
    if AS_PAGES:
        bad = m & ((v < 1) | (v > num_pages))
        page = tl.where(bad, sink, v)
    else:
        bad = m & ((v < 0) | (v >= rows))
        if ALLOW_MINUS_ONE:
            bad = bad & (v != -1)
        page = tl.where(bad | (v < 0), sink, v // page_size)
    return bad, page


# Integers are not specialised: which compiled kernel serves a call then depends only on what
# launch.CompiledLaunch keys on, not on the values of n, site or the pool's sizes.
_CHECK_INTS = ["n", "rows", "page_size", "num_pages", "sink", "site"]


@triton.jit
def _check_body(offs, m, idx_ptr, state_ptr, owner_ptr, flags_ptr, vsite_ptr, counters_ptr, oor_ptr, req_ptr,
                rows, page_size, num_pages, sink, site,
                OP: tl.constexpr, PAGE_STARTS: tl.constexpr, AS_PAGES: tl.constexpr, HAS_REQ: tl.constexpr,
                WEIGHT: tl.constexpr, KIND_SLOT: tl.constexpr, KIND_BIT: tl.constexpr,
                OOR_SLOT: tl.constexpr, OOR_BIT: tl.constexpr):
    v = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    bad, page = _pages(v, m, rows, page_size, num_pages, sink, AS_PAGES, OP == LAST_LOC)
    n_bad = tl.sum(bad.to(tl.int64), axis=0)
    if n_bad > 0:
        tl.atomic_add(counters_ptr + OOR_SLOT, n_bad * WEIGHT)
        tl.atomic_max(oor_ptr, tl.max(tl.where(bad & (v >= 0), v, 0), axis=0))
        tl.atomic_min(oor_ptr + 1, tl.min(tl.where(bad & (v < 0), v, 0), axis=0))
        tl.atomic_or(flags_ptr + sink, OOR_BIT)
        tl.store(vsite_ptr + sink, site)
    live = m & (page != sink)
    st = tl.load(state_ptr + page, mask=m, other=0).to(tl.int32)
    if OP == ALLOC:
        new = live
        if PAGE_STARTS:
            new = new & ((v % page_size) == 0)
        viol = new & (st != FREE)
    elif OP == LAST_LOC:
        viol = live & (((st & FREE) != 0) | ((st & HELD) == 0))
        if HAS_REQ:
            own = tl.load(owner_ptr + page, mask=m, other=-1).to(tl.int64)
            req = tl.load(req_ptr + offs, mask=m, other=-1).to(tl.int64)
            viol = viol | (live & (st == OWNED) & (own >= 0) & (own != req))
    else:
        viol = live & ((st & FREE) != 0)
    n_viol = tl.sum(viol.to(tl.int64), axis=0)
    if n_viol > 0:
        tl.atomic_add(counters_ptr + KIND_SLOT, n_viol * WEIGHT)
        tl.atomic_or(flags_ptr + page, tl.full(page.shape, KIND_BIT, tl.int32), mask=viol)
        tl.store(vsite_ptr + page, tl.full(page.shape, site, tl.int32), mask=viol)


@triton.jit
def _write_body(offs, m, idx_ptr, state_ptr, owner_ptr, alloc_site_ptr, rows, page_size, num_pages, sink, site,
                OP: tl.constexpr, PAGE_STARTS: tl.constexpr, AS_PAGES: tl.constexpr, EVICTING: tl.constexpr):
    v = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    bad, page = _pages(v, m, rows, page_size, num_pages, sink, AS_PAGES, False)
    live = m & (page != sink)
    if OP == ALLOC:
        if PAGE_STARTS:
            live = live & ((v % page_size) == 0)
        tl.store(state_ptr + page, tl.full(page.shape, OWNED, tl.int8), mask=live)
        tl.store(owner_ptr + page, tl.full(page.shape, -1, tl.int32), mask=live)
        tl.store(alloc_site_ptr + page, tl.full(page.shape, site, tl.int32), mask=live)
    elif OP == FREEING:
        if EVICTING:
            tl.store(state_ptr + page, tl.full(page.shape, FREE, tl.int8), mask=live)
        else:
            st = tl.load(state_ptr + page, mask=live, other=0).to(tl.int32)
            tl.store(state_ptr + page, ((st & TREE) | FREE).to(tl.int8), mask=live)
    else:
        tl.store(state_ptr + page, tl.full(page.shape, TREE, tl.int8), mask=live)
        tl.store(owner_ptr + page, tl.full(page.shape, -1, tl.int32), mask=live)


@triton.jit(do_not_specialize=_CHECK_INTS)
def _check(idx_ptr, n, state_ptr, owner_ptr, flags_ptr, vsite_ptr, counters_ptr, oor_ptr, req_ptr,
           rows, page_size, num_pages, sink, site,
           OP: tl.constexpr, PAGE_STARTS: tl.constexpr, AS_PAGES: tl.constexpr, HAS_REQ: tl.constexpr,
           WEIGHT: tl.constexpr, KIND_SLOT: tl.constexpr, KIND_BIT: tl.constexpr,
           OOR_SLOT: tl.constexpr, OOR_BIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _check_body(offs, offs < n, idx_ptr, state_ptr, owner_ptr, flags_ptr, vsite_ptr, counters_ptr, oor_ptr, req_ptr,
                rows, page_size, num_pages, sink, site, OP, PAGE_STARTS, AS_PAGES, HAS_REQ, WEIGHT, KIND_SLOT, KIND_BIT,
                OOR_SLOT, OOR_BIT)


@triton.jit(do_not_specialize=_CHECK_INTS)
def _write(idx_ptr, n, state_ptr, owner_ptr, alloc_site_ptr, rows, page_size, num_pages, sink, site,
           OP: tl.constexpr, PAGE_STARTS: tl.constexpr, AS_PAGES: tl.constexpr, EVICTING: tl.constexpr,
           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _write_body(offs, offs < n, idx_ptr, state_ptr, owner_ptr, alloc_site_ptr, rows, page_size, num_pages, sink, site,
                OP, PAGE_STARTS, AS_PAGES, EVICTING)


@triton.jit(do_not_specialize=_CHECK_INTS)
def _check_write(idx_ptr, n, state_ptr, owner_ptr, flags_ptr, vsite_ptr, counters_ptr, oor_ptr, alloc_site_ptr,
                 rows, page_size, num_pages, sink, site,
                 OP: tl.constexpr, PAGE_STARTS: tl.constexpr, AS_PAGES: tl.constexpr, EVICTING: tl.constexpr,
                 WEIGHT: tl.constexpr, KIND_SLOT: tl.constexpr, KIND_BIT: tl.constexpr,
                 OOR_SLOT: tl.constexpr, OOR_BIT: tl.constexpr, BLOCK: tl.constexpr):
    """Both passes in one program, for a call of at most BLOCK indices: every thread has read the
    states it checks before the barrier, and writes only after it."""
    offs = tl.arange(0, BLOCK)
    m = offs < n
    _check_body(offs, m, idx_ptr, state_ptr, owner_ptr, flags_ptr, vsite_ptr, counters_ptr, oor_ptr, idx_ptr,
                rows, page_size, num_pages, sink, site, OP, PAGE_STARTS, AS_PAGES, False, WEIGHT, KIND_SLOT, KIND_BIT,
                OOR_SLOT, OOR_BIT)
    tl.debug_barrier()
    _write_body(offs, m, idx_ptr, state_ptr, owner_ptr, alloc_site_ptr, rows, page_size, num_pages, sink, site,
                OP, PAGE_STARTS, AS_PAGES, EVICTING)


@triton.jit(do_not_specialize=["n_last", "n", "rows", "page_size", "num_pages", "sink", "site"])
def _last_loc_check_write(last_ptr, n_last, req_ptr, idx_ptr, n, state_ptr, owner_ptr, flags_ptr, vsite_ptr, counters_ptr,
                          oor_ptr, alloc_site_ptr, rows, page_size, num_pages, sink, site,
                          HAS_REQ: tl.constexpr, STALE_SLOT: tl.constexpr, STALE_BIT: tl.constexpr,
                          TAKEN_SLOT: tl.constexpr, TAKEN_BIT: tl.constexpr, OOR_SLOT: tl.constexpr, OOR_BIT: tl.constexpr,
                          BLOCK: tl.constexpr):
    """A paged alloc's last_loc check and the alloc's own update in one program, for calls of at
    most BLOCK of each: both checks read the states before the barrier, as the two kernels in
    turn would (the host's call between them changes no ledger state), and the alloc writes after."""
    offs = tl.arange(0, BLOCK)
    _check_body(offs, offs < n_last, last_ptr, state_ptr, owner_ptr, flags_ptr, vsite_ptr, counters_ptr, oor_ptr, req_ptr,
                rows, page_size, num_pages, sink, site, LAST_LOC, False, False, HAS_REQ, 1, STALE_SLOT, STALE_BIT,
                OOR_SLOT, OOR_BIT)
    m = offs < n
    _check_body(offs, m, idx_ptr, state_ptr, owner_ptr, flags_ptr, vsite_ptr, counters_ptr, oor_ptr, idx_ptr,
                rows, page_size, num_pages, sink, site, ALLOC, True, False, False, 1, TAKEN_SLOT, TAKEN_BIT,
                OOR_SLOT, OOR_BIT)
    tl.debug_barrier()
    _write_body(offs, m, idx_ptr, state_ptr, owner_ptr, alloc_site_ptr, rows, page_size, num_pages, sink, site,
                ALLOC, True, False, False)


@triton.jit(do_not_specialize=["n", "req_value", "rows", "page_size", "sink"])
def _owner(idx_ptr, n, state_ptr, owner_ptr, req_ptr, req_value, rows, page_size, sink,
           REQ_TENSOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    ok = m & (v >= 0) & (v < rows)
    page = tl.where(ok, v // page_size, sink)
    st = tl.load(state_ptr + page, mask=ok, other=0).to(tl.int32)
    if REQ_TENSOR:
        req = tl.load(req_ptr + offs, mask=m, other=-1).to(tl.int32)
    else:
        req = tl.full(page.shape, req_value, tl.int32)
    tl.store(owner_ptr + page, req, mask=ok & (st == OWNED))


class LedgerKernels:
    """Binds the kernels to one ledger's tensors."""

    block = BLOCK

    def __init__(self, ledger: Any) -> None:
        self.led = ledger
        self.slot = KIND_SLOT
        self.bits = KIND_BITS
        self.check_launch = CompiledLaunch(_check)
        self.write_launch = CompiledLaunch(_write)
        self.fused_launch = CompiledLaunch(_check_write)
        self.owner_launch = CompiledLaunch(_owner)
        self.last_loc_alloc_launch = CompiledLaunch(_last_loc_check_write)
        led = ledger
        self.device = led.state.device.index if led.state.device.index is not None else 0
        self.torch_device = led.state.device
        self.sizes = (led.rows, led.page_size, led.num_pages, led.sink)
        ledger_tensors = (led.state, led.owner, led.flags, led.violation_site, led.counters, led.oor_value, led.alloc_site)
        # the ledger's own tensors are torch's allocations (aligned); were one not, nothing is keyed on it
        self.keyable = fits_i32(*self.sizes) and all(aligned(t) for t in ledger_tensors)
        self._constants: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._planned: set[tuple[Any, ...]] = set()  # (kernel, key) handed to the native fast path

    def direct(self) -> bool:
        """Whether the fused kernel launches through the CUDA driver (then the native fast path may too)."""
        return self.keyable and self.fused_launch.driver is not None

    def launchers(self) -> tuple[CompiledLaunch, ...]:
        return (self.check_launch, self.write_launch, self.fused_launch, self.owner_launch, self.last_loc_alloc_launch)

    def index(self, tensor: Any) -> Any:
        """The call's indices as the kernels read them, one after another in memory: an index tensor
        already on the ledger's device is read as it is (int32 or int64, the kernels widen it), a
        strided one copied; anything else is moved."""
        flat = tensor.reshape(-1) if getattr(tensor, "device", None) == self.torch_device and tensor.dtype in _INDEX_DTYPES else self.led.xp.index(tensor)
        return flat if flat.is_contiguous() else flat.contiguous()

    def _key(self, constants: dict[str, Any], *tensors: Any) -> tuple[Any, ...]:
        return (*constants.values(), *((t.dtype, aligned(t)) for t in tensors), self.device) if self.keyable else ()

    def _launch(self, launch: CompiledLaunch, n: int, args: tuple[Any, ...], constants: dict[str, Any], key: tuple[Any, ...]) -> None:
        grid = triton.cdiv(n, BLOCK)
        if key and fits_i32(n):
            launch(grid, args, constants, key, self.device)
        else:
            launch.fn[(grid,)](*args, num_warps=plan_slots.LEDGER_WARPS, **constants)

    def _rule(self, kernel: str, op: int, kind: str = "", *, page_starts: bool = False, as_pages: bool = False,
              evicting: bool = False, weight: int = 1, has_req: bool = False) -> dict[str, Any]:
        """One kernel's constants for one kind of call, built once, in the kernel's own order (a
        compiled launch passes them by position): `check`, `write` or `fused`."""
        rule = (kernel, op, kind, page_starts, as_pages, evicting, weight, has_req)
        constants = self._constants.get(rule)
        if constants is None:
            constants = {"OP": op, "PAGE_STARTS": page_starts, "AS_PAGES": as_pages}
            if kernel == "check":
                constants["HAS_REQ"] = has_req
            else:
                constants["EVICTING"] = evicting
            if kernel != "write":
                constants.update(
                    WEIGHT=weight, KIND_SLOT=self.slot[kind], KIND_BIT=self.bits[kind],
                    OOR_SLOT=self.slot[schema.INDEX_OUT_OF_RANGE], OOR_BIT=self.bits[schema.INDEX_OUT_OF_RANGE],
                )
            constants["BLOCK"] = BLOCK
            self._constants[rule] = constants
        return constants

    def _check_and_write(self, idx: Any, site: int, op: int, kind: str, *, page_starts: bool = False, as_pages: bool = False,
                         evicting: bool = False, weight: int = 1) -> None:
        """A state change: its rule checked against the states before the call, then applied. One
        launch where the call fits one program (a decode step's allocation, most frees), else two."""
        n = idx.numel()
        if n <= BLOCK:
            led = self.led
            constants = self._rule("fused", op, kind, page_starts=page_starts, as_pages=as_pages, evicting=evicting, weight=weight)
            args = (idx, n, led.state, led.owner, led.flags, led.violation_site, led.counters, led.oor_value, led.alloc_site,
                    *self.sizes, site)
            key = self._key(constants, idx) if fits_i32(site) else ()
            self._launch(self.fused_launch, n, args, constants, key)
            if key and (self.fused_launch.fn, key) not in self._planned and op != OP_TREE_INSERT:
                slot = plan_slots.device_slot(op, idx, page_starts=page_starts, as_pages=as_pages, evicting=evicting)
                self._hand_to_fast_path(self.fused_launch, key, slot, args, (0, 1, len(args) - 1))
            return
        checked = self._check(idx, site, op, kind, page_starts=page_starts, as_pages=as_pages, weight=weight)
        written = self._write(idx, site, op, page_starts=page_starts, as_pages=as_pages, evicting=evicting)
        if checked[0] and written[0] and fits_i32(n) and op != OP_TREE_INSERT and (self.write_launch.fn, written[0]) not in self._planned:
            # both kernels to C, by the fused plan's rule: the check's indices are its rows (8)
            slot = plan_slots.device_slot(op, idx, page_starts=page_starts, as_pages=as_pages, evicting=evicting)
            self._hand_to_fast_path(self.check_launch, checked[0], plan_slots.BLOCKS_CHECK + slot, checked[1], (0, 1, 13, 8))
            self._hand_to_fast_path(self.write_launch, written[0], plan_slots.BLOCKS_WRITE + slot, written[1], (0, 1, 9))

    def _hand_to_fast_path(self, launch: CompiledLaunch, key: tuple[Any, ...], slot: int, args: tuple[Any, ...],
                           per_call: tuple[int, ...]) -> None:
        """A kernel this call compiled and launched through the driver, handed to the native fast path
        (launch.c) with its fixed parameters: the next such call launches from there. `per_call`:
        where the index, its count and the site go (and the owner kernel's rows), which C fills in."""
        plan, kernel = launch.plans.get(key), launch.compiled.get(key)
        if kernel is None:
            return
        self._planned.add((launch.fn, key))
        if plan is None or launch.driver is None:
            return
        kinds, block, shared = plan
        try:
            values = tuple(0 if i in per_call else a.data_ptr() if k == 112 else a for i, (a, k) in enumerate(zip(args, kinds, strict=True)))
            device_plan(self.led, slot, kernel.function, kinds, block, shared, values, *per_call)
        except Exception:  # a plan C does not take: this kernel stays on the Python path
            return

    def _check(self, idx: Any, site: int, op: int, kind: str, *, page_starts: bool = False, as_pages: bool = False,
               req: Any = None, weight: int = 1) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """The check kernel over every program of the call; its compiled kernel's key and arguments."""
        led = self.led
        n = idx.numel()
        req_arg = req if req is not None else idx
        constants = self._rule("check", op, kind, page_starts=page_starts, as_pages=as_pages, weight=weight, has_req=req is not None)
        args = (idx, n, led.state, led.owner, led.flags, led.violation_site, led.counters, led.oor_value, req_arg,
                *self.sizes, site)
        key = self._key(constants, idx, req_arg) if fits_i32(site) else ()
        self._launch(self.check_launch, n, args, constants, key)
        if op == OP_LAST_LOC and key and fits_i32(n) and (self.check_launch.fn, key) not in self._planned:
            # per call: last_loc (0), its count (1), the site (13) and the rows it was read for (8)
            self._hand_to_fast_path(self.check_launch, key, plan_slots.last_loc_slot(idx, req), args, (0, 1, len(args) - 1, 8))
        return key, args

    def _write(self, idx: Any, site: int, op: int, *, page_starts: bool = False, as_pages: bool = False,
               evicting: bool = False) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        led = self.led
        n = idx.numel()
        constants = self._rule("write", op, page_starts=page_starts, as_pages=as_pages, evicting=evicting)
        args = (idx, n, led.state, led.owner, led.alloc_site, *self.sizes, site)
        key = self._key(constants, idx) if fits_i32(site) else ()
        self._launch(self.write_launch, n, args, constants, key)
        return key, args

    def alloc(self, idx: Any, site: int, page_starts: bool) -> None:
        if idx.numel():
            self._check_and_write(idx, site, OP_ALLOC, schema.DOUBLE_ALLOC, page_starts=page_starts)

    def free(self, idx: Any, site: int, evicting: bool, as_pages: bool) -> None:
        if idx.numel():
            weight = self.led.page_size if as_pages else 1
            self._check_and_write(idx, site, OP_FREE, schema.DOUBLE_FREE, as_pages=as_pages, evicting=evicting, weight=weight)

    def tree_insert(self, idx: Any, site: int) -> None:
        if idx.numel():
            self._check_and_write(idx, site, OP_TREE_INSERT, schema.USE_AFTER_FREE)

    def last_loc(self, idx: Any, site: int, req: Any) -> None:
        if idx.numel():
            self._check(idx, site, OP_LAST_LOC, schema.STALE_LAST_LOC, req=req)

    def _last_loc_alloc_rule(self, has_req: bool) -> dict[str, Any]:
        """`_last_loc_check_write`'s constants, in its own order (a compiled launch passes them by position)."""
        constants = self._constants.get(("last_loc_alloc", has_req))
        if constants is None:
            constants = self._constants[("last_loc_alloc", has_req)] = {
                "HAS_REQ": has_req,
                "STALE_SLOT": self.slot[schema.STALE_LAST_LOC], "STALE_BIT": self.bits[schema.STALE_LAST_LOC],
                "TAKEN_SLOT": self.slot[schema.DOUBLE_ALLOC], "TAKEN_BIT": self.bits[schema.DOUBLE_ALLOC],
                "OOR_SLOT": self.slot[schema.INDEX_OUT_OF_RANGE], "OOR_BIT": self.bits[schema.INDEX_OUT_OF_RANGE],
                "BLOCK": BLOCK,
            }
        return constants

    def last_loc_alloc(self, last: Any, site: int, req: Any, idx: Any, page_starts: bool) -> None:
        """A paged alloc's last_loc check, then its update: one launch where both fit one program,
        else the two rules in turn (the same checks of the same states either way)."""
        n_last, n = last.numel(), idx.numel()
        if not (n_last and n and page_starts and n_last <= BLOCK and n <= BLOCK):
            self.last_loc(last, site, req)
            if n:
                self._check_and_write(idx, site, OP_ALLOC, schema.DOUBLE_ALLOC, page_starts=page_starts)
            return
        led = self.led
        has_req = req is not None
        constants = self._last_loc_alloc_rule(has_req)
        req_arg = req if has_req else last
        args = (last, n_last, req_arg, idx, n, led.state, led.owner, led.flags, led.violation_site, led.counters, led.oor_value,
                led.alloc_site, *self.sizes, site)
        key = self._key(constants, last, req_arg, idx) if fits_i32(site) else ()
        launch = self.last_loc_alloc_launch
        self._launch(launch, 1, args, constants, key)
        if key and (launch.fn, key) not in self._planned:
            # per call: the slots (3), their count (4), the site, the rows (2), last_loc (0) and its count (1)
            self._hand_to_fast_path(launch, key, plan_slots.last_loc_alloc_slot(last, req, idx), args, (3, 4, len(args) - 1, 2, 0, 1))

    def owner(self, idx: Any, req: Any) -> None:
        led = self.led
        n = idx.numel()
        if not n:
            return
        tensor = not isinstance(req, int)
        req_arg = req if tensor else idx
        constants = {"REQ_TENSOR": tensor, "BLOCK": BLOCK}
        args = (idx, n, led.state, led.owner, req_arg, 0 if tensor else req, led.rows, led.page_size, led.sink)
        key = self._key(constants, idx, req_arg) if fits_i32(0 if tensor else req) else ()
        self._launch(self.owner_launch, n, args, constants, key)
        if key and fits_i32(n) and (self.owner_launch.fn, key) not in self._planned:
            # per call: the slots (0), their count (1), the rows (4) and the row (5)
            self._hand_to_fast_path(self.owner_launch, key, plan_slots.owner_slot(idx, req if tensor else None), args, (0, 1, 5, 4))

