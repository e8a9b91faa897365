"""Reading traces: streamed, never loaded whole, and readable after a crash.

A cut last line is skipped, damaged lines are counted and skipped, and a trace from a newer
schema is refused with a sentence (`TraceError`). `TraceTail` follows a trace another process is
still writing.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

from kvdoctor.errors import TraceError
from kvdoctor.trace.codec import loads
from kvdoctor.trace.schema import HEADER, RUN_HEADER, SCHEMA_NAME, SCHEMA_VERSION, TRACE_END, Event


@dataclasses.dataclass
class ReadStats:
    """What the reader met besides events: a cut tail, unreadable lines, headers seen."""

    events: int = 0
    corrupt_lines: int = 0
    truncated_tail: bool = False
    clean_end: bool = False
    headers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    bytes_read: int = 0
    oversized_lines: int = 0

    def notes(self) -> list[str]:
        out = []
        if self.oversized_lines:
            out.append(
                f"{self.oversized_lines} line(s) longer than {MAX_LINE_BYTES >> 20} MiB were skipped (no kvdoctor event is that long)"
            )
        if self.truncated_tail:
            out.append("the trace ends mid-line (the writer was cut off); the partial last line was skipped")
        if self.corrupt_lines:
            out.append(f"{self.corrupt_lines} unreadable line(s) were skipped")
        if not self.clean_end and not self.truncated_tail:
            out.append("the trace has no end marker (the run was still going or was killed)")
        return out


MAX_LINE_BYTES = 16 << 20  # an event line longer than this is skipped: memory stays bounded whatever the file
MAX_HEADERS_KEPT = 4096  # process headers remembered for the notes (bounded, like the rest)


def _lines(fh: BinaryIO, stats: ReadStats) -> Iterator[bytes]:
    """The file's lines, each read with a bounded buffer; over-long ones are skipped and counted."""
    while True:
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            stats.oversized_lines += 1
            stats.bytes_read += len(line)
            while line and not line.endswith(b"\n"):
                line = fh.readline(MAX_LINE_BYTES)
                stats.bytes_read += len(line)
            continue
        yield line


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


def open_regular(path: str, what: str = "trace file") -> BinaryIO:
    """`path` opened for reading when it is a regular file; a FIFO, a device or a socket is
    refused with a sentence (opening a FIFO would wait for a writer forever, and reading a device
    never ends), without blocking to find out."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise TraceError(f"{path}: no such {what}", "check the path given to --trace") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a {what}") from None
    except PermissionError:
        raise TraceError(f"{path}: permission denied") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot be opened ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise TraceError(f"{path}: is a directory, not a {what}")
        if not stat.S_ISREG(mode):
            raise TraceError(f"{path}: is {_kind_of(mode)}, not a {what}", "give the path of a trace kvdoctor wrote")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind_of(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def unreadable(path: str, exc: OSError) -> TraceError:
    """The sentence for a trace whose bytes cannot be read (an I/O error, a file of /proc)."""
    return TraceError(f"{path}: cannot be read ({exc.strerror or exc})", "copy the trace to a regular file and try again")


def open_trace(path: str) -> BinaryIO:
    """The trace opened for reading, past its opening bracket; a sentence when it cannot be."""
    fh = open_regular(path)
    try:
        first = fh.read(1)
        while first in (b" ", b"\n", b"\r", b"\t"):
            first = fh.read(1)
        if first == b"":
            raise TraceError(f"{path}: the trace is empty", "the probe never wrote to it; was the run under `kvdoctor run`?")
        if first != b"[":
            raise TraceError(f"{path}: not a kvdoctor trace (it does not start with '[')")
    except OSError as exc:
        fh.close()
        raise unreadable(path, exc) from None
    except BaseException:
        fh.close()
        raise
    return fh


class LineDecoder:
    """Turns one trace line into an event, with every rule of the reader: the header first, a
    cut last line, damaged lines counted. Shared by `iter_events` and the block replay, so both
    read every line the same way."""

    def __init__(self, path: str, stats: ReadStats) -> None:
        self.path = path
        self.stats = stats
        self.seen_header = False
        self.gave_up = False  # too many unreadable lines before any header: not a trace

    def decode(self, line: bytes, complete: bool | None = None) -> Event | None:
        """The line's event, or None for a blank, bracket or unreadable line. A line is complete
        when it ends in a newline, unless `complete` says (for lines already split apart)."""
        stats = self.stats
        if complete is None:
            complete = line.endswith(b"\n")
        text = line.strip()
        if not text or text == b"]":
            return None
        if text.endswith(b","):
            text = text[:-1]
        try:
            raw = loads(text)
        except (ValueError, TypeError, RecursionError):
            if not complete:
                stats.truncated_tail = True
            else:
                stats.corrupt_lines += 1
                if not self.seen_header and stats.corrupt_lines > 16:
                    self.gave_up = True
            return None
        if not isinstance(raw, dict):
            stats.corrupt_lines += 1
            return None
        event = Event.from_json_dict(raw)
        if event.name in (HEADER, RUN_HEADER):
            check_header(event.args, self.path)
            self.seen_header = True
            if len(stats.headers) < MAX_HEADERS_KEPT:
                stats.headers.append(event.args)
        elif not self.seen_header:
            raise TraceError(f"{self.path}: the first event is not a kvdoctor header", "is this a kvdoctor trace?")
        if event.name == TRACE_END:
            stats.clean_end = True
        stats.events += 1
        return event

    def finish(self) -> None:
        if not self.seen_header:
            raise TraceError(f"{self.path}: no readable kvdoctor header in the trace", "the file is corrupt or not a kvdoctor trace")


def iter_events(path: str, stats: ReadStats | None = None) -> Iterator[Event]:
    """Streams a trace's events. Raises TraceError only when nothing usable can be read.

    A trace whose first readable event is not a kvdoctor header is refused; after that, damaged
    lines are counted and skipped so that everything still readable is analysed.
    """
    stats = stats if stats is not None else ReadStats()
    with open_trace(path) as fh:
        stats.bytes_read = 1
        decoder = LineDecoder(path, stats)
        lines = _lines(fh, stats)
        while True:
            try:
                line = next(lines, b"")
            except OSError as exc:
                raise unreadable(path, exc) from None
            if not line:
                break
            stats.bytes_read += len(line)
            event = decoder.decode(line)
            if decoder.gave_up:
                break
            if event is not None:
                yield event
        decoder.finish()


class TraceTail:
    """Follows a trace another process is still writing: complete lines only, from where it left off.

    `names` keeps only those events (None keeps every event); a line that does not parse is
    skipped, as `iter_events` does, and is never retried.
    """

    READ_LIMIT_BYTES = 8 << 20

    def __init__(self, path: str, names: frozenset[str] | None = None) -> None:
        self.path = path
        self.names = names
        self.offset = 0
        self.partial = b""

    def poll(self) -> list[Event]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(self.READ_LIMIT_BYTES)
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            text = line.strip().rstrip(b",")
            if not text.startswith(b"{"):
                continue
            try:
                raw = loads(text)
            except (ValueError, TypeError, RecursionError):
                continue
            if isinstance(raw, dict) and (self.names is None or raw.get("name") in self.names):
                out.append(Event.from_json_dict(raw))
        return out
