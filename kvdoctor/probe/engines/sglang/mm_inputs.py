"""Multimodal inputs held by finished requests: the bytes of their feature tensors (pixel values,
audio features) still alive after the result that finished them was processed.

A request's `multimodal_inputs` (`MultimodalInputs`, its `mm_items` each a `MultimodalDataItem`)
carries the processor's `feature` tensor; `ScheduleBatch.prepare_for_extend` moves it to the batch's
device and writes it back into the item. Up to 0.5.7 nothing drops it when the request finishes: it
lives as long as anything holds the request, its inputs or a batch's `multimodal_inputs` list (a
batch whose requests all finished keeps that list: `filter_batch` returns early), and on a VLM
server GPU memory grows until OOM (sglang#7340, #8429, #8902). From 0.5.8 `Scheduler.process_batch_result`
ends with `_maybe_clear_mm_inputs(batch)`, which sets each finished request's `item.feature = None`
and `req.multimodal_inputs = None` (PR#17324; from 0.5.12 through `MultimodalInputs.release_features()`);
a session's request keeps its inputs for the session's next turn, on purpose.

Once `Scheduler.process_batch_result` returned (the slot ledger's `batch_result` hook), the probe reads
the batch's finished requests (instance attributes and slots only: no property, no host code) and,
for one that still holds a feature tensor, notes its rid, bytes (`nbytes`: no GPU sync), device and a
weak reference to each tensor (bounded). A noted hold still alive at a later count is said in an
`mm_inputs` event: at the next processed result, on the writer thread's round once older than
`KVDOCTOR_MM_HELD_AGE_S` (5 s by default), and at exit; a hold said before and gone since is said
released. A decoding request keeps its features in every release (a retracted request prefills
again), so only finished requests are judged, and a session's never.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base.objects import own, own_slot
from kvdoctor.probe.base.settings import DAY_S, env_number
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext

LEDGER = "mm_inputs"
MAX_TRACKED = 4096  # finished requests whose features are watched; past it, counted as untracked
MAX_REQS_READ = 1 << 14  # requests of one batch read after its result
MAX_ITEMS = 64  # multimodal items read per request
MAX_NAMED = 64  # holds listed in one event
MIN_EVENT_INTERVAL_S = 1.0  # a busy engine's counts go to the trace at most this often (exit always)
ENV_HELD_AGE_S = "KVDOCTOR_MM_HELD_AGE_S"
DEFAULT_HELD_AGE_S = 5.0  # a hold counted on the writer thread's round only once this old


def held_age_from_env() -> float:
    """How old a hold must be for the writer thread's round to count it (`KVDOCTOR_MM_HELD_AGE_S`,
    5 s by default); a value that is not a finite number leaves the default."""
    return env_number(ENV_HELD_AGE_S, DEFAULT_HELD_AGE_S, high=30 * DAY_S)


class NotUnderstood(Exception):
    """A request's multimodal inputs are not laid out as this ledger reads them."""


class Hold:
    """One finished request's feature tensors, weakly."""

    __slots__ = ("rid", "nbytes", "device", "items", "finished_at", "result", "refs", "req")

    def __init__(self, rid: str, tensors: list[Any], req: Any, result: int) -> None:
        self.rid = rid
        self.nbytes = [int(t.nbytes) for t in tensors]
        torch = sys.modules.get("torch")
        first = tensors[0]
        self.device = str(first.device) if torch is not None and isinstance(first, torch.Tensor) else "cpu"  # numpy: host
        self.items = len(tensors)
        self.finished_at = time.monotonic()
        self.result = result  # the result processing (counted from 1) that finished it
        self.refs = [weakref.ref(t) for t in tensors]
        try:
            self.req: Any = weakref.ref(req)
        except TypeError:
            self.req = None

    def alive_bytes(self) -> int:
        return sum(n for n, ref in zip(self.nbytes, self.refs, strict=True) if ref() is not None)

    def request_alive(self) -> bool | None:
        return None if self.req is None else self.req() is not None


class MmInputsLedger:
    """Per-process: the finished requests' holds still watched, the results processed, and what
    the last event said. Fed on the scheduler's thread; counted there and on the writer thread."""

    def __init__(self, probe: ProbeContext | None = None) -> None:
        self.lock = threading.Lock()
        self.holds: dict[str, Hold] = {}
        self.results = 0
        self.untracked = 0  # holds not watched: the table was full
        self.finished_read = 0  # finished requests read after their result (session requests not counted)
        self.noted = 0  # of them, those that still held features
        self.said: tuple[Any, ...] = ()
        self.said_rids: set[str] = set()  # holds named in an event, whose release is said in turn
        self.released: list[str] = []  # of them, those gone since, not said yet
        self.last_said = -math.inf
        self.scheduler = ""
        self.held_age_s = held_age_from_env()
        self.seen_inputs = False  # a batch has listed a request's multimodal inputs

    def after_result(self, probe: ProbeContext, scheduler: Any, batch: Any) -> None:
        """A forward result was processed: note its finished requests that still hold features,
        then count the holds noted at earlier results. Until a batch has carried multimodal inputs
        (an extend batch lists each request's, `prepare_for_extend`), no request is read: a text
        server pays one attribute read and a C-level count per result."""
        self.results += 1
        if not self.seen_inputs:
            listed = own(batch, "multimodal_inputs")
            if not isinstance(listed, list) or listed.count(None) == len(listed):
                return
            self.seen_inputs = True
        self.scheduler = self.scheduler or type(scheduler).__name__
        reqs = own(batch, "reqs")
        if isinstance(reqs, list):
            for req in reqs[:MAX_REQS_READ]:
                if own(req, "finished_reason") is None or own(req, "session") is not None:
                    continue
                self.finished_read += 1
                tensors = features(own(req, "multimodal_inputs"))
                if tensors:
                    self.noted += 1
                    self.note(req, tensors)
        if self.holds or self.released:
            self.count(probe, "result", lambda h: h.result < self.results)

    def note(self, req: Any, tensors: list[Any]) -> None:
        rid = own(req, "rid")
        rid = rid if isinstance(rid, str) else f"id {id(req)}"
        with self.lock:
            if rid in self.holds:
                return
            if len(self.holds) >= MAX_TRACKED:
                self.untracked += 1
                return
            self.holds[rid] = Hold(rid, tensors, req, self.results)

    def count(self, probe: ProbeContext, when: str, due: Any, *, force: bool = False) -> None:
        """The noted holds still alive and `due`, and those said before that are gone since: said
        when that changed, at most once every MIN_EVENT_INTERVAL_S (or `force`)."""
        now = time.monotonic()
        with self.lock:
            held = []
            for rid, hold in list(self.holds.items()):
                alive = hold.alive_bytes()
                if alive == 0:
                    del self.holds[rid]
                    if rid in self.said_rids:
                        self.said_rids.discard(rid)
                        if len(self.released) < MAX_TRACKED:
                            self.released.append(rid)
                elif due(hold):
                    held.append((hold, alive))
            key = tuple((h.rid, n) for h, n in held)
            if not force:
                if not self.released and (not held or key == self.said):
                    return
                if now - self.last_said < MIN_EVENT_INTERVAL_S:
                    return  # said at a later count: the releases wait in self.released
            released, self.released = self.released[:MAX_NAMED], self.released[MAX_NAMED:]
            self.said, self.last_said = key, now
            self.said_rids.update(h.rid for h, _ in held[:MAX_NAMED])
            untracked = self.untracked
        by_device: dict[str, int] = {}
        for hold, alive in held:
            by_device[hold.device] = by_device.get(hold.device, 0) + alive
        probe.emitter.emit(
            schema.MM_INPUTS,
            {
                "when": when,
                "scheduler": self.scheduler or "Scheduler",
                "results_processed": self.results,
                "finished_requests_read": self.finished_read,
                "finished_with_features": self.noted,
                "held_requests": len(held),
                "bytes": sum(n for _, n in held),
                "by_device": by_device,
                "untracked_requests": untracked,
                "released": released[:MAX_NAMED],  # named before, their tensors gone since
                "held": [
                    {
                        "rid": hold.rid,
                        "bytes": alive,
                        "device": hold.device,
                        "items": hold.items,
                        "held_s": round(now - hold.finished_at, 3),
                        "results_since_finish": self.results - hold.result,
                        "request_alive": hold.request_alive(),
                    }
                    for hold, alive in held[:MAX_NAMED]
                ],
            },
        )

    def periodic(self, probe: ProbeContext) -> None:
        if probe.ledger_is_on(LEDGER) and self.holds:
            self.count(probe, "periodic", lambda h: time.monotonic() - h.finished_at >= self.held_age_s)

    def close(self, probe: ProbeContext, reason: str) -> None:
        if probe.ledger_is_on(LEDGER) and self.results:  # said once at exit, held or not
            self.count(probe, reason, lambda h: True, force=True)


def features(mm_inputs: Any) -> list[Any]:
    """The feature tensors (torch tensors or numpy arrays, the only types read: their `nbytes` is C
    code) of a request's multimodal inputs; [] for none. NotUnderstood for inputs whose items are
    not a list."""
    if mm_inputs is None:
        return []
    items = own(mm_inputs, "mm_items")
    if not isinstance(items, list):
        raise NotUnderstood(f"{type(mm_inputs).__name__}.mm_items is {type(items).__name__} (a list was expected)")
    kinds = array_types()
    out = []
    for item in items[:MAX_ITEMS]:
        feature = own(item, "feature")
        if feature is None:  # from 0.5.20 an item is a msgspec Struct: its fields are slots
            feature = own_slot(item, "feature")
        if feature is not None and isinstance(feature, kinds) and int(getattr(feature, "nbytes", 0)) > 0:
            out.append(feature)
    return out


def array_types() -> tuple[type, ...]:
    """torch.Tensor and numpy.ndarray, as far as the host imported them (never imported here)."""
    out: list[type] = []
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(getattr(torch, "Tensor", None), type):
        out.append(torch.Tensor)
    if numpy is not None and isinstance(getattr(numpy, "ndarray", None), type):
        out.append(numpy.ndarray)
    return tuple(out)


def state(probe: ProbeContext) -> MmInputsLedger:
    return probe.state(LEDGER, MmInputsLedger)


def after_result(probe: ProbeContext, scheduler: Any, batch: Any) -> None:
    """The slot ledger's `batch_result` hook hands each processed result here; a layout this does
    not read turns this ledger off (said once), never the others."""
    if not probe.ledger_is_on(LEDGER):
        return
    try:
        state(probe).after_result(probe, scheduler, batch)
    except Exception as exc:  # NotUnderstood, or inputs of a shape this never met: only this ledger stops
        probe.turn_off_ledger(LEDGER, "the multimodal inputs ledger", exc)
