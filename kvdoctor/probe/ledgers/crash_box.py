"""A slot ledger's violation counters in a file that outlives the process: what a crash would lose.

A rule broken at a hooked call sets the ledger's counters and page bits at once, but the writer
thread reads them and writes the violation only on its next round (every 0.5-2 s). A process that
dies in between (a device-side assert right after an out-of-range index, an abort, an OOM kill)
took the finding with it: on an H200 SGLang 0.5.23's own store kernel asserted 1 s after kvdoctor's
check had counted the planted index, and the trace named nothing. So under `kvdoctor run`, whose
run directory its probes share (`KVDOCTOR_RENDEZVOUS`), each ledger's counters, worst out-of-range
values, page bits and violation sites live in a shared file mapping instead of private memory: the
same stores, no extra work. On a GPU the file is in /dev/shm, registered with CUDA as mapped host
memory, so the ledger's kernels write it as they wrote device memory (only when a rule is broken).
`kvdoctor run` reads what the trace lacks once the command has ended (kvdoctor.delivery.crash_boxes).

A sidecar JSON beside it names the pid, the ledger, the layout and the call sites (rewritten when a
new site is interned: once a site, a few hundred bytes); each violation handed to the emitter is kept there too, with
its evidence, as the emitter's buffer is lost with the process. Memory: 8 bytes a page plus 160, e.g. 8 MiB for a million pages.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from kvdoctor.probe.base.shutdown import ENV_RENDEZVOUS
from kvdoctor.probe.base.vocabulary import KIND_BITS, KIND_SLOT
from kvdoctor.trace.schema import VIOLATION

ENV_CRASH_BOX = "KVDOCTOR_CRASH_BOX"  # "0" keeps the counters in private memory
SIDECAR_SUFFIX = ".box.json"
SHM = "/dev/shm"
MAX_NOTED = 64  # violation events kept as emitted, a ledger
_CUDA_HOST_REGISTER_MAPPED = 2


def layout(kinds: int, n: int) -> dict[str, tuple[int, int, str]]:
    """name -> (byte offset, count, dtype) of each array in the file, each 64-byte aligned (the
    kernels' launches are keyed on their pointers' 16-byte alignment)."""
    out: dict[str, tuple[int, int, str]] = {}
    offset = 0
    for name, count, dtype, size in (
        ("counters", kinds, "int64", 8),
        ("oor_value", 2, "int64", 8),
        ("flags", n, "int32", 4),
        ("violation_site", n, "int32", 4),
    ):
        out[name] = (offset, count, dtype)
        offset += -(-count * size // 64) * 64
    return out


class CrashBox:
    """One ledger's file: its arrays as numpy views (host ledgers) or CUDA tensors on mapped host memory."""

    def __init__(self, path: str, sidecar: str, body: dict[str, Any], mapping: mmap.mmap) -> None:
        self.path, self.sidecar, self.body, self.mapping = path, sidecar, body, mapping
        self.sites_written = 0
        self.noted = 0
        self.registered: Any = None  # (cudart, address) while CUDA holds the mapping pinned

    def noting(self, emit: Callable[..., None]) -> Callable[..., None]:
        """`emit`, each violation it is handed kept in the box too (`note_emitted`)."""

        def emit_and_note(name: str, args: dict[str, Any], *rest: Any, **options: Any) -> None:
            emit(name, args, *rest, **options)
            if name == VIOLATION:
                self.note_emitted(args)

        return emit_and_note

    def note_emitted(self, args: dict[str, Any]) -> None:
        """A violation handed to the emitter, whose buffer a crash takes before it reaches the trace:
        its evidence kept beside the counters (violations are rare; at most MAX_NOTED a ledger)."""
        if self.noted >= MAX_NOTED:
            return
        self.noted += 1
        try:
            with open(self.body["emitted"], "a") as fh:
                fh.write(json.dumps(args, default=str) + "\n")
        except OSError:
            pass

    def views(self) -> dict[str, np.ndarray]:
        out = {}
        for name, (offset, count, dtype) in self.body["layout"].items():
            out[name] = np.frombuffer(self.mapping, dtype=dtype, count=count, offset=offset)
        return out

    def write_sites(self, names: list[str]) -> None:
        """The call sites so far (from the writer thread: a few hundred bytes, when they grew)."""
        if len(names) == self.sites_written:
            return
        self.sites_written = len(names)
        temp = f"{self.sidecar}.{os.getpid()}.tmp"
        try:
            with open(temp, "w") as fh:
                json.dump({**self.body, "sites": list(names)}, fh)
            os.replace(temp, self.sidecar)
        except OSError:  # the run's directory gone (the run ended) or full: the counters stand, unnamed sites
            pass


def open_box(ledger: Any, n: int, device: Any) -> CrashBox | None:
    """A box for `ledger` (None outside `kvdoctor run`, when switched off, or where one cannot be
    made: the ledger keeps private arrays, as before)."""
    directory = os.environ.get(ENV_RENDEZVOUS, "")
    if not directory or not os.path.isdir(directory) or os.environ.get(ENV_CRASH_BOX, "1") == "0":
        return None
    cuda = str(device).startswith("cuda")
    kinds = len(KIND_SLOT)
    arrays = layout(kinds, n)
    size = max(offset + count * np.dtype(dtype).itemsize for offset, count, dtype in arrays.values())
    stem = f"{os.getpid()}-{id(ledger):x}"
    where = os.path.join(SHM, f"kvdoctor-box-{os.path.basename(directory)}-{stem}") if cuda else os.path.join(directory, stem)
    fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    body = {
        "pid": os.getpid(),
        "allocator": ledger.name,
        "page_size": ledger.page_size,
        "rows": ledger.rows,
        "num_pages": ledger.num_pages,
        "sink": ledger.sink,
        "data": where,
        "emitted": os.path.join(directory, stem + ".emitted.jsonl"),
        "layout": arrays,
        "kinds": dict(KIND_SLOT),
        "bits": dict(KIND_BITS),
    }
    box = CrashBox(where, os.path.join(directory, stem + SIDECAR_SUFFIX), body, mapping)
    box.write_sites(["unknown"])
    return box


def adopt(ledger: Any, n: int, device: Any) -> None:
    """Puts `ledger`'s counters, worst values, page bits and sites in a crash box where it can
    (`ledger.crash_box`; `ledger.crash_box_off` says why not: the ledger works either way). A
    device ledger only where its kernels run: the torch path would write host memory every call."""
    ledger.crash_box, ledger.crash_box_off = None, ""
    if not ledger.xp.sync_free_branching and ledger.kernels is None:
        ledger.crash_box_off = "no crash box: a device ledger without its kernels"
        return
    ledger.crash_box_off = _adopt(ledger, n, device)


def _adopt(ledger: Any, n: int, device: Any) -> str:
    try:
        box = open_box(ledger, n, device)
    except OSError as exc:
        return f"no crash box: {exc.strerror or exc}"
    if box is None:
        return "no crash box (outside kvdoctor run)"
    try:
        views = box.views()
        if ledger.xp.sync_free_branching:
            ledger.counters, ledger.oor_value = views["counters"], views["oor_value"]
            ledger.flags, ledger.violation_site = views["flags"], views["violation_site"]
        else:
            tensors = _cuda_tensors(box, views, ledger.state.device)
            ledger.counters, ledger.oor_value = tensors["counters"], tensors["oor_value"]
            ledger.flags, ledger.violation_site = tensors["flags"], tensors["violation_site"]
    except Exception as exc:  # the box is dropped, the ledger's own arrays stay
        close(box)
        return f"no crash box: {type(exc).__name__}: {exc}"
    ledger.crash_box = box
    ledger.emit = box.noting(ledger.emit)
    box.write_sites(ledger.sites.names)
    ledger.sites.on_new.append(box.write_sites)  # a site interned at the call that broke a rule, named even so
    return ""


class _CudaArray:
    """Mapped host memory as CUDA sees it, for torch.as_tensor (the device pointer is the host's: UVA)."""

    def __init__(self, address: int, count: int, dtype: str) -> None:
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": np.dtype(dtype).str, "data": (address, False), "version": 3}


def _cuda_tensors(box: CrashBox, views: dict[str, np.ndarray], device: Any) -> dict[str, Any]:
    """The views as CUDA tensors on the same bytes, checked once both ways at creation (off the hot
    path): a store on the device must land in the file, and one in the file must reach the device."""
    import torch

    base = views["counters"].ctypes.data
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(base, len(box.mapping), _CUDA_HOST_REGISTER_MAPPED)
    if int(getattr(err, "value", err)) != 0:
        raise OSError(f"cudaHostRegister failed ({err})")
    box.registered = (cudart, base)
    with torch.cuda.device(device):
        out = {name: torch.as_tensor(_CudaArray(v.ctypes.data, v.size, v.dtype.str), device=device) for name, v in views.items()}
        probe = out["violation_site"]
        views["violation_site"][0] = 7
        probe[1:2].fill_(9)
        torch.cuda.synchronize(device)
        seen = int(probe[0:1].cpu()[0]), int(views["violation_site"][1])
        views["violation_site"][:2] = 0
    if seen != (7, 9):
        raise OSError(f"mapped host memory does not round-trip on {device}: {seen}")
    return out


def close(box: CrashBox | None) -> None:
    """Unpins and unmaps (at a clean exit; a crashed process leaves the file for `kvdoctor run`)."""
    if box is None:
        return
    if box.registered is not None:
        try:
            box.registered[0].cudaHostUnregister(box.registered[1])
        except Exception:
            pass
        box.registered = None
