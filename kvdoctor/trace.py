"""Writing and reading traces: appended in batches, readable after a crash, streamed on read.

The writer side is imported by the in-process probe, so it uses only the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Iterator

from kvdoctor.errors import TraceError
from kvdoctor.schema import (
    HEADER,
    RUN_HEADER,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    TRACE_END,
    Event,
)

try:  # orjson is several times faster; the stdlib is the fallback everywhere.
    import orjson as _orjson

    def _dumps(obj: Any) -> bytes:
        try:
            return _orjson.dumps(obj, option=_orjson.OPT_SERIALIZE_NUMPY, default=_default)
        except TypeError:  # integers beyond 64 bits and other values orjson refuses
            return json.dumps(_finite(obj), separators=(",", ":"), default=_default).encode()

    def _loads(data: bytes) -> Any:
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError:
            return json.loads(data)  # integers beyond 64 bits, which orjson does not read

except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

    def _dumps(obj: Any) -> bytes:
        return json.dumps(_finite(obj), separators=(",", ":"), default=_default).encode()

    _loads = json.loads


def _finite(obj: Any) -> Any:
    """NaN and infinities become null, as orjson writes them: the trace stays strict JSON."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _default(obj: Any) -> Any:
    """Numbers from numpy/torch and sets reach the trace as plain JSON values."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def now_us() -> float:
    return time.time() * 1e6


def encode_event(event: Event | dict[str, Any]) -> bytes:
    raw = event.to_json_dict() if isinstance(event, Event) else event
    return _dumps(raw) + b",\n"


class TraceWriter:
    """Appends events to a trace file. Safe to share between processes (O_APPEND, whole batches).

    The first writer to create the file writes the opening bracket. `write_batch` issues one
    `write(2)` per batch, so a crash loses at most the batch in flight, never earlier lines.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            os.write(fd, b"[\n")
        except FileExistsError:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._fd: int | None = fd

    def write_batch(self, events: list[Event | dict[str, Any]]) -> int:
        if self._fd is None or not events:
            return 0
        payload = b"".join(encode_event(e) for e in events)
        view = memoryview(payload)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        return len(payload)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def finish_trace(path: str, pid: int) -> None:
    """Closes the JSON array so the file is strict JSON too (only when every writer is done)."""
    end = Event(ph="M", name=TRACE_END, pid=pid, args={"ended_at_us": now_us()}).to_json_dict()
    with open(path, "ab") as fh:
        fh.write(_dumps(end) + b"\n]\n")


@dataclasses.dataclass
class ReadStats:
    """What the reader met besides events: a cut tail, unreadable lines, headers seen."""

    events: int = 0
    corrupt_lines: int = 0
    truncated_tail: bool = False
    clean_end: bool = False
    headers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    bytes_read: int = 0

    def notes(self) -> list[str]:
        out = []
        if self.truncated_tail:
            out.append("the trace ends mid-line (the writer was cut off); the partial last line was skipped")
        if self.corrupt_lines:
            out.append(f"{self.corrupt_lines} unreadable line(s) were skipped")
        if not self.clean_end and not self.truncated_tail:
            out.append("the trace has no end marker (the run was still going or was killed)")
        return out


def check_header(args: dict[str, Any], path: str) -> None:
    schema = args.get("schema")
    if not isinstance(schema, str) or "/" not in schema:
        raise TraceError(f"{path}: the header has no schema version", "is this a kvdoctor trace?")
    name, _, version_text = schema.rpartition("/")
    if name != SCHEMA_NAME:
        raise TraceError(f"{path}: schema {schema!r} is not a kvdoctor trace schema")
    try:
        version = int(version_text)
    except ValueError:
        raise TraceError(f"{path}: unreadable schema version {version_text!r}") from None
    if version > SCHEMA_VERSION:
        raise TraceError(
            f"{path}: written by a newer kvdoctor (schema {version}, this one reads up to {SCHEMA_VERSION})",
            "upgrade kvdoctor to analyse it",
        )
    if version < 1:
        raise TraceError(f"{path}: schema version {version} is not one kvdoctor ever wrote")


def iter_events(path: str, stats: ReadStats | None = None) -> Iterator[Event]:
    """Streams a trace's events. Raises TraceError only when nothing usable can be read.

    A trace whose first readable event is not a kvdoctor header is refused; after that, damaged
    lines are counted and skipped so that everything still readable is analysed.
    """
    stats = stats if stats is not None else ReadStats()
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file", "check the path given to --trace") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except PermissionError:
        raise TraceError(f"{path}: permission denied") from None
    with fh:
        first = fh.read(1)
        while first in (b" ", b"\n", b"\r", b"\t"):
            first = fh.read(1)
        if first == b"":
            raise TraceError(f"{path}: the trace is empty", "the probe never wrote to it; was the run under `kvdoctor run`?")
        if first != b"[":
            raise TraceError(f"{path}: not a kvdoctor trace (it does not start with '[')")
        stats.bytes_read = 1
        seen_header = False
        for line in fh:
            stats.bytes_read += len(line)
            complete = line.endswith(b"\n")
            text = line.strip()
            if not text or text == b"]":
                continue
            if text.endswith(b","):
                text = text[:-1]
            try:
                raw = _loads(text)
            except (ValueError, TypeError, RecursionError):
                if not complete:
                    stats.truncated_tail = True
                else:
                    stats.corrupt_lines += 1
                    if not seen_header and stats.corrupt_lines > 16:
                        break
                continue
            if not isinstance(raw, dict):
                stats.corrupt_lines += 1
                continue
            event = Event.from_json_dict(raw)
            if event.name in (HEADER, RUN_HEADER):
                check_header(event.args, path)
                seen_header = True
                stats.headers.append(event.args)
            elif not seen_header:
                raise TraceError(f"{path}: the first event is not a kvdoctor header", "is this a kvdoctor trace?")
            if event.name == TRACE_END:
                stats.clean_end = True
            stats.events += 1
            yield event
        if not seen_header:
            raise TraceError(f"{path}: no readable kvdoctor header in the trace", "the file is corrupt or not a kvdoctor trace")
