"""Ledger arrays that live where the host's indices live, and a way to read them without a sync.

On CPU the ledger is numpy over the same memory torch uses, and every read is immediate. On a
GPU the ledger is torch tensors on that device; reads go through pinned host buffers copied with
`non_blocking=True` behind a CUDA event, so the scheduler's stream never waits for the probe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class HostArrays:
    """numpy ledger for indices that live on the CPU. Branching on values costs nothing here."""

    sync_free_branching = True
    device = "cpu"

    def zeros(self, n: int, dtype: str) -> np.ndarray:
        return np.zeros(n, dtype=dtype)

    def full(self, n: int, value: int, dtype: str) -> np.ndarray:
        return np.full(n, value, dtype=dtype)

    def single(self, tensor: Any) -> int | None:
        """The value of a one-element integer tensor, else None. The commonest call (one decode
        slot) reads it with `item()`: a numpy view plus an int64 copy cost several times more."""
        try:
            if tensor.numel() != 1:
                return None
            value = tensor.item()
        except Exception:  # not a tensor (numpy arrays have no numel)
            return None
        return value if isinstance(value, int) else None

    def index(self, tensor: Any) -> np.ndarray:
        """The host's index tensor as an int64 array (zero-copy for CPU int64 tensors)."""
        if isinstance(tensor, np.ndarray):
            return tensor.astype(np.int64, copy=False).reshape(-1)
        if hasattr(tensor, "detach"):
            try:
                arr = tensor.numpy()  # zero-copy; index tensors never require grad
            except RuntimeError:
                arr = tensor.detach().numpy()
            if arr.ndim != 1:
                arr = arr.reshape(-1)
            out: np.ndarray = arr if arr.dtype == np.int64 else arr.astype(np.int64)
            return out
        return np.asarray(tensor, dtype=np.int64).reshape(-1)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return np.where(cond, a, b)

    def cast(self, arr: Any, like: np.ndarray) -> Any:
        return np.asarray(arr).astype(like.dtype, copy=False)

    def to_host(self, arr: Any) -> np.ndarray:
        return np.asarray(arr)

    def snapshot(self, arrays: Sequence[Any]) -> ReadyRead:
        return ReadyRead([np.array(a, copy=True) for a in arrays])

    def or_repeated(self, mask: np.ndarray, pages: np.ndarray, sink: int) -> np.ndarray:
        """`mask`, and where an entry names a page an earlier entry of the same call named (the
        sink, where out-of-range entries are parked, aside): a page freed or taken twice in one call."""
        if pages.size < 2:
            return mask
        order = np.argsort(pages, kind="stable")
        ranked = pages[order]
        again = (ranked[1:] == ranked[:-1]) & (ranked[1:] != sink)
        if not again.any():
            return mask
        out = np.array(mask, dtype=bool, copy=True)
        out[order[1:][again]] = True
        return out


class ReadyRead:
    def __init__(self, values: list[np.ndarray]) -> None:
        self.values = values

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def get(self) -> list[np.ndarray]:
        return self.values


class DeviceArrays:
    """torch ledger on the indices' device. Never reads a value back on the hot path."""

    sync_free_branching = False

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self._dtypes = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}

    def zeros(self, n: int, dtype: str) -> Any:
        return self.torch.zeros(n, dtype=self._dtypes[dtype], device=self.device)

    def full(self, n: int, value: int, dtype: str) -> Any:
        return self.torch.full((n,), value, dtype=self._dtypes[dtype], device=self.device)

    def index(self, tensor: Any) -> Any:
        t = tensor if hasattr(tensor, "to") else self.torch.as_tensor(tensor)
        return t.reshape(-1).to(device=self.device, dtype=self.torch.int64, non_blocking=True)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self.torch.where(cond, a, b)

    def cast(self, arr: Any, like: Any) -> Any:
        if not hasattr(arr, "to"):
            arr = self.torch.as_tensor(arr, device=self.device)
        return arr.to(like.dtype)

    def or_repeated(self, mask: Any, pages: Any, sink: int) -> Any:
        """Not judged on a device: a sort on every call (a page named twice in one call is missed there)."""
        return mask

    def to_host(self, arr: Any) -> np.ndarray:
        # Only used at a census (idle engine) or at exit, where a sync harms no one. A copy: the
        # ledger keeps changing (and flags are cleared) after the read.
        return np.array(arr.detach().cpu().numpy(), copy=True)

    def snapshot(self, arrays: Sequence[Any]) -> Any:
        if self.device.type != "cuda":
            return ReadyRead([self.to_host(a) for a in arrays])
        return PendingDeviceRead(self.torch, arrays)


class PendingDeviceRead:
    """Copies device tensors into pinned host memory behind an event; `ready()` never blocks."""

    def __init__(self, torch: Any, arrays: Sequence[Any]) -> None:
        self._host = [torch.empty(a.shape, dtype=a.dtype, pin_memory=True) for a in arrays]
        for host, dev in zip(self._host, arrays, strict=False):
            host.copy_(dev, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        return bool(self._event.query())

    def wait(self) -> None:
        self._event.synchronize()

    def get(self) -> list[np.ndarray]:
        return [h.numpy() for h in self._host]


def arrays_for(device: Any) -> HostArrays | DeviceArrays:
    name = str(device)
    if name == "cpu" or name.startswith("cpu:"):
        return HostArrays()
    return DeviceArrays(device)
