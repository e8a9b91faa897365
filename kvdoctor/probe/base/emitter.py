"""Buffers the probe's events in bounded memory and writes them from a background thread.

Hooks only append to a deque; a daemon thread writes a batch every `flush_interval_s`. When the
writer falls behind, events are dropped and counted (reported in `probe_stats`), never queued
without bound. A write error (full disk, file removed) stops writing and is kept as the reason;
under `run` it is also left in the run's directory, since the trace can no longer say it.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from kvdoctor.probe.base.shutdown import note_writer_stopped
from kvdoctor.probe.base.slot_tracks import SlotTracks
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, now_us, redact_args


def read_process_title(pid: int | str = "self") -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read(4096)
    except OSError:
        return ""
    parts = [p.decode("utf-8", "replace") for p in raw.split(b"\0") if p]
    return " ".join(redact_args(parts))[:200]


class Emitter:
    def __init__(
        self, path: str | None, *, max_buffered: int = 200_000, flush_interval_s: float = 0.5, header_args: dict[str, Any] | None = None
    ) -> None:
        self.path = path
        self.pid = os.getpid()
        self.max_buffered = max_buffered
        self.flush_interval_s = flush_interval_s
        self.header_args = dict(header_args or {})
        self.buffer: collections.deque[schema.Event] = collections.deque()
        self.dropped = 0
        self._dropped_reported = 0
        self.written_events = 0
        self.written_bytes = 0
        self.write_error: str | None = None
        self._writer: TraceWriter | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._title = ""
        self.periodic: list[Callable[[], None]] = []
        self.listeners: list[Callable[[schema.Event], None]] = []
        self.header_written = False
        self.slot_tracks = SlotTracks()  # the histories an event carries, on their slots' tracks too
        if hasattr(os, "register_at_fork"):
            own = weakref.WeakMethod(self._after_fork)

            def after_fork() -> None:
                method = own()
                if method is not None:
                    method()

            os.register_at_fork(after_in_child=after_fork)

    def _after_fork(self) -> None:
        """A forked child is a process of its own: its own pid and header, a fresh writer thread
        (threads do not survive fork), and none of the parent's buffered events (the parent writes them)."""
        self.pid = os.getpid()
        self.buffer = collections.deque()
        self.dropped = self._dropped_reported = 0
        self.written_events = self.written_bytes = 0
        self._writer = None
        self._thread = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.header_written = False
        self.slot_tracks = SlotTracks()

    def emit(self, name: str, args: dict[str, Any], *, ph: str = "i", cat: str = schema.CAT_PROBE) -> None:
        event = schema.Event(ph=ph, name=name, pid=self.pid, ts=now_us(), cat=cat, tid=threading.get_ident() & 0xFFFF, args=args)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                pass
        if len(self.buffer) >= self.max_buffered:
            self.dropped += 1
            return
        self.buffer.append(event)
        self._ensure_thread()

    def counter(self, name: str, args: dict[str, Any]) -> None:
        self.emit(name, args, ph="C")

    @property
    def closing(self) -> bool:
        """Set once `close` began: background readers stop emitting into a trace that is ending."""
        return self._stop.is_set()

    def _ensure_thread(self) -> None:
        if self._thread is None and self.path and self.write_error is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvdoctor-writer", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            for task in list(self.periodic):
                try:
                    task()
                except Exception:
                    pass
            self.flush()

    def _header_events(self) -> list[schema.Event]:
        title = read_process_title()
        self._title = title
        header = schema.header_event(
            pid=self.pid,
            engine=str(self.header_args.get("engine", "")),
            engine_version=str(self.header_args.get("engine_version", "")),
            process_title=title,
            extra={k: v for k, v in self.header_args.items() if k not in ("engine", "engine_version")},
        )
        name = schema.Event(ph="M", name=schema.PROCESS_NAME, pid=self.pid, args={"name": title[:80]})
        return [header, name]

    def flush(self) -> None:
        if not self.path or self.write_error is not None:
            self.buffer.clear()
            return
        with self._lock:
            batch: list[Any] = []
            if not self.header_written:
                batch.extend(self._header_events())
            else:
                title = read_process_title()
                if title and title != self._title:
                    self._title = title
                    batch.append(schema.Event(ph="M", name=schema.PROCESS_NAME, pid=self.pid, args={"name": title[:80]}))
            if self.dropped != self._dropped_reported:
                # said outside the bounded buffer, which is exactly what was full
                self._dropped_reported = self.dropped
                batch.append(schema.Event(ph="C", name=schema.PROBE_STATS, pid=self.pid, ts=now_us(), args=self.stats()))
            while self.buffer:
                event = self.buffer.popleft()
                batch.append(event)
                if event.args and schema.SLOT_HISTORY in event.args:
                    batch.extend(self.slot_tracks.events_for(event))
                if len(batch) >= 8192:
                    self._write(batch)
                    batch = []
            if batch:
                self._write(batch)

    def _write(self, batch: list[Any]) -> None:
        try:
            if self._writer is None:
                self._writer = TraceWriter(self.path)  # type: ignore[arg-type]
            self.written_bytes += self._writer.write_batch(batch)
            self.written_events += len(batch)
            self.header_written = True
        except Exception as exc:  # full disk, removed directory, permissions: stop writing
            self.write_error = f"{type(exc).__name__}: {exc}"
            self.dropped += len(batch)
            self.buffer.clear()
            note_writer_stopped(self.write_error)  # the trace cannot say it any more

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def stats(self) -> dict[str, Any]:
        return {
            "buffered": len(self.buffer),
            "dropped_events": self.dropped,
            "written_events": self.written_events,
            "written_bytes": self.written_bytes,
            "write_error": self.write_error or "",
            "time_s": time.time(),
        }


def say(line: str) -> None:
    """One line on stderr for what a serving engineer must know (a map not tested for this
    release, a ledger off); never raises."""
    try:
        sys.stderr.write(f"kvdoctor: {line}\n")
        sys.stderr.flush()
    except Exception:
        pass
