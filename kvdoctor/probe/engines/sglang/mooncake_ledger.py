"""HiCache's L3 store, page by page: which keys were written, read back, never read, or read
without ever being written, and how many bytes the store holds for this process.

SGLang's zero-copy storage backends (Mooncake's `MooncakeStore` among them) take one key per
page: `batch_set_v1(keys, host_indices)` and `batch_get_v1(keys, host_indices)` return one bool
per key, `batch_exists(keys)` the number of leading keys present. The ledger keeps one small
integer per key (its state bits, under the key's hash: no key text is kept but a few samples),
bounded at `MAX_KEYS`; past that it counts without adding keys and says so. Bytes are pages times
the host pool's page size (K and V): what the store was asked to keep, an upper bound on what it
still holds after its own eviction; a Mooncake client mounted in this process (not standalone)
keeps them in its own segment here, so `segment_bytes` bounds them in this process. The backup and prefetch threads call these methods, never the
scheduler's thread, so the bookkeeping sits beside the store's own network round trip.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

MAX_KEYS = 1 << 17  # 131072 pages; about 10 MiB of dict at most
SAMPLE_KEYS = 4
REPORT_INTERVAL_S = 2.0

WRITTEN = 1  # a batch_set_v1 stored it (or found it stored)
READ = 2  # a batch_get_v1 read it back
READ_MISS = 4  # a batch_get_v1 of it failed


class L3Ledger:
    """Per-process ledger of one or more L3 stores (keys by hash, counts, bytes)."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.lock = threading.Lock()
        self.keys: dict[int, int] = {}
        self.page_bytes: dict[int, int] = {}  # id(store) -> bytes of one page (0: unknown)
        self.segment_bytes = 0  # the Mooncake segments this process mounted for its stores
        self.backends: dict[str, int] = {}
        self.samples_unread: dict[int, str] = {}
        self.samples_unwritten: list[str] = []
        self.counts = {
            "set_calls": 0,
            "set_pages": 0,
            "set_failed_pages": 0,
            "set_again_pages": 0,
            "get_calls": 0,
            "get_pages": 0,
            "get_hit_pages": 0,
            "get_miss_pages": 0,
            "exists_calls": 0,
            "exists_pages": 0,
            "exists_hit_pages": 0,
            "keys_written": 0,
            "keys_read": 0,
            "reads_of_unwritten": 0,
            "read_misses_of_written": 0,
            "bytes_written": 0,
            "distinct_key_bytes": 0,
            "untracked_keys": 0,
            "untracked_reads": 0,
        }
        self.last_report = 0.0
        self.reported: tuple[int, ...] = ()

    def store_page_bytes(self, store: Any) -> int:
        key = id(store)
        known = self.page_bytes.get(key)
        if known is not None:
            return known
        size = 0
        host = getattr(store, "mem_pool_host", None)
        if host is not None:
            try:
                size = int(host.get_size_per_token()) * int(host.page_size)
            except Exception:
                size = 0
        if size > 0:  # only once the host pool is registered; until then, asked again
            self.page_bytes[key] = size
            name = type(store).__name__
            self.backends[name] = size
            config = getattr(store, "config", None)
            segment = getattr(config, "global_segment_size", 0)
            if isinstance(segment, int) and segment > 0 and not getattr(config, "standalone_storage", False):
                self.segment_bytes += segment
        return size

    def _slot(self, key: Any) -> tuple[int, int | None]:
        """The key's hash and its state bits (None: not tracked)."""
        h = hash(key)
        return h, self.keys.get(h)

    def on_set(self, store: Any, keys: list[Any], results: Any) -> None:
        page = self.store_page_bytes(store)
        ok = _per_key(results, len(keys))
        c = self.counts
        with self.lock:
            c["set_calls"] += 1
            c["set_pages"] += len(keys)
            for key, stored in zip(keys, ok, strict=False):
                if not stored:
                    c["set_failed_pages"] += 1
                    continue
                c["bytes_written"] += page
                h, bits = self._slot(key)
                if bits is None:
                    if len(self.keys) >= MAX_KEYS:
                        c["untracked_keys"] += 1
                        continue
                    bits = 0
                if bits & WRITTEN:
                    c["set_again_pages"] += 1  # backed up again: the store found it and kept the first copy
                else:
                    c["keys_written"] += 1
                    c["distinct_key_bytes"] += page
                    if len(self.samples_unread) < SAMPLE_KEYS:
                        self.samples_unread[h] = str(key)
                self.keys[h] = bits | WRITTEN

    def on_get(self, store: Any, keys: list[Any], results: Any) -> None:
        ok = _per_key(results, len(keys))
        c = self.counts
        with self.lock:
            c["get_calls"] += 1
            c["get_pages"] += len(keys)
            for key, hit in zip(keys, ok, strict=False):
                c["get_hit_pages" if hit else "get_miss_pages"] += 1
                h, bits = self._slot(key)
                if bits is None and len(self.keys) >= MAX_KEYS:
                    c["untracked_reads"] += 1  # the ledger is full: written or not, it cannot tell
                    continue
                if bits is None or not bits & WRITTEN:
                    c["reads_of_unwritten"] += 1
                    if len(self.samples_unwritten) < SAMPLE_KEYS:
                        self.samples_unwritten.append(str(key))
                    continue
                if hit and not bits & READ:
                    c["keys_read"] += 1
                    self.samples_unread.pop(h, None)
                elif not hit and not bits & READ_MISS:
                    c["read_misses_of_written"] += 1
                self.keys[h] = bits | (READ if hit else READ_MISS)

    def on_exists(self, keys: list[Any], hits: Any) -> None:
        c = self.counts
        with self.lock:
            c["exists_calls"] += 1
            c["exists_pages"] += len(keys)
            if isinstance(hits, int) and not isinstance(hits, bool):
                c["exists_hit_pages"] += max(0, min(hits, len(keys)))

    def summary(self) -> dict[str, Any]:
        with self.lock:
            out: dict[str, Any] = dict(self.counts)
            out["keys_never_read"] = out["keys_written"] - out["keys_read"]
            out["page_bytes"] = max(self.page_bytes.values(), default=0)
            out["bytes_never_read"] = out["keys_never_read"] * out["page_bytes"]
            out["backends"] = dict(self.backends)
            out["segment_bytes"] = self.segment_bytes
            out["tracked_keys"] = len(self.keys)
            out["max_keys"] = MAX_KEYS
            out["sample_unread_keys"] = list(self.samples_unread.values())
            out["sample_unwritten_keys"] = list(self.samples_unwritten)
        return out

    def periodic(self, probe: ProbeContext) -> None:
        if not probe.ledger_is_on("l3"):
            return
        with self.lock:
            counts = dict(self.counts)
        counts["keys_never_read"] = counts["keys_written"] - counts["keys_read"]
        probe.emitter.counter(schema.L3_COUNTER, counts)
        now = time.monotonic()
        if now - self.last_report >= REPORT_INTERVAL_S:
            self.report(probe, now)

    def report(self, probe: ProbeContext, now: float | None = None, *, force: bool = False) -> None:
        """The ledger's summary with sample keys, when it changed (`force`: at exit)."""
        self.last_report = time.monotonic() if now is None else now
        key = tuple(self.counts.values())
        if not force and key == self.reported:
            return
        self.reported = key
        if self.counts["set_calls"] or self.counts["get_calls"] or self.counts["exists_calls"]:
            probe.emitter.emit(schema.L3_KEYS, self.summary())

    def close(self, probe: ProbeContext, reason: str) -> None:
        if probe.ledger_is_on("l3"):
            self.report(probe, force=True)


def _per_key(results: Any, n: int) -> list[bool]:
    """A v1 call's result as one bool per key: a list of bools, or one bool for the whole batch."""
    if isinstance(results, (list, tuple)):
        return [bool(r) for r in results[:n]] + [False] * max(0, n - len(results))
    return [bool(results)] * n


def state(probe: ProbeContext) -> L3Ledger:
    return probe.state("l3", L3Ledger)


class L3Role(Role):
    ledger = "l3"
    reads = {"keys": 0}

    def keys(self, hook: Hook, args: Args, kwargs: Kwargs) -> list[Any] | None:
        keys = hook.arg(args, kwargs, "keys")
        return list(keys) if isinstance(keys, (list, tuple)) else None


class L3SetRole(L3Role):
    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        keys = self.keys(hook, args, kwargs)
        if keys is not None:
            state(probe).on_set(obj, keys, result)


class L3GetRole(L3Role):
    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        keys = self.keys(hook, args, kwargs)
        if keys is not None:
            state(probe).on_get(obj, keys, result)


class L3ExistsRole(L3Role):
    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        keys = self.keys(hook, args, kwargs)
        if keys is not None:
            state(probe).on_exists(keys, result)


ROLES: dict[str, Role] = {"l3_set": L3SetRole(), "l3_get": L3GetRole(), "l3_exists": L3ExistsRole()}
