"""Attribution windows as pprof profiles, the format Pyroscope and `go tool pprof` read.

Each `host_growth_sites` window of each process becomes one gzipped `profile.proto` message: one
sample per growing site, valued in bytes and allocations gained over the window, its location the
site's file:line (and, for memray windows, the Python stack above it), labelled as `run --metrics`
labels its series (engine, version, pid, title) plus the thread that grew it. The message is
encoded here with protobuf's wire format (varints and length-delimited fields): the few fields a
profile needs, no generated code and no dependency.
"""

from __future__ import annotations

import gzip
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from kvdoctor.outputs import claim_folder, write_private
from kvdoctor.trace import schema
from kvdoctor.trace.writer import redact
from kvdoctor.units import as_int, finite_number

# profile.proto field numbers (github.com/google/pprof/proto/profile.proto)
PROFILE_SAMPLE_TYPE, PROFILE_SAMPLE, PROFILE_MAPPING, PROFILE_LOCATION, PROFILE_FUNCTION, PROFILE_STRINGS = 1, 2, 3, 4, 5, 6
PROFILE_TIME_NANOS, PROFILE_DURATION_NANOS, PROFILE_PERIOD_TYPE, PROFILE_PERIOD, PROFILE_COMMENT = 9, 10, 11, 12, 13
_STACK_ENTRY = re.compile(r"^(?P<file>.+):(?P<line>\d+) in (?P<function>.+)$")


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 negatives as two's complement, as protobuf encodes them
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value) if value else b""


def _bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _packed(field: int, values: Iterable[int]) -> bytes:
    return _bytes(field, b"".join(_varint(v) for v in values))


class _Profile:
    """Builds one profile: strings, functions and locations interned as it goes."""

    def __init__(self) -> None:
        self.strings: dict[str, int] = {"": 0}
        self.functions: dict[tuple[str, str], int] = {}
        self.locations: dict[tuple[int, int], int] = {}
        self.body = bytearray()

    def string(self, text: str) -> int:
        return self.strings.setdefault(text, len(self.strings))

    def location(self, file: str, line: int, function: str) -> int:
        fid = self.functions.get((function, file))
        if fid is None:
            fid = self.functions[(function, file)] = len(self.functions) + 1
            name = self.string(function)
            self.body += _bytes(PROFILE_FUNCTION, _int(1, fid) + _int(2, name) + _int(3, name) + _int(4, self.string(file)))
        lid = self.locations.get((fid, line))
        if lid is None:
            lid = self.locations[(fid, line)] = len(self.locations) + 1
            self.body += _bytes(PROFILE_LOCATION, _int(1, lid) + _int(2, 1) + _bytes(4, _int(1, fid) + _int(2, line)))
        return lid

    def sample(self, locations: list[int], values: list[int], labels: dict[str, str]) -> None:
        encoded_labels = b"".join(_bytes(3, _int(1, self.string(k)) + _int(2, self.string(v))) for k, v in labels.items() if v)
        self.body += _bytes(PROFILE_SAMPLE, _packed(1, locations) + _packed(2, values) + encoded_labels)

    def finish(self, time_ns: int, duration_ns: int, comment: str) -> bytes:
        head = _bytes(PROFILE_SAMPLE_TYPE, _int(1, self.string("space")) + _int(2, self.string("bytes")))
        head += _bytes(PROFILE_SAMPLE_TYPE, _int(1, self.string("objects")) + _int(2, self.string("count")))
        # one mapping that says the functions, files and lines are already there: nothing to symbolize
        head += _bytes(PROFILE_MAPPING, _int(1, 1) + _int(5, self.string("python")) + _int(7, 1) + _int(8, 1) + _int(9, 1))
        tail = _int(PROFILE_TIME_NANOS, time_ns) + _int(PROFILE_DURATION_NANOS, duration_ns)
        tail += _bytes(PROFILE_PERIOD_TYPE, _int(1, self.string("space")) + _int(2, self.string("bytes")))
        tail += _int(PROFILE_COMMENT, self.string(comment))
        strings = b"".join(_bytes(PROFILE_STRINGS, s.encode()) for s in self.strings)
        return head + bytes(self.body) + tail + strings


def _frames(site: dict[str, Any]) -> list[tuple[str, int, str]]:
    """The site's frames, leaf first: memray's stack where the window has one, else its file:line."""
    frames = []
    for entry in site.get("stack") or []:
        match = _STACK_ENTRY.match(str(entry))
        if match:
            frames.append((match["file"], int(match["line"]), match["function"]))
    if not frames:
        file = str(site.get("file") or site.get("site") or "?")
        frames.append((file, as_int(site.get("line")), str(site.get("function") or site.get("site") or file)))
    return frames


def _nanoseconds(value: Any, per_unit: float) -> int:
    """`value` (seconds or µs) in ns for an int64 field; 0 where a damaged trace has no finite
    number there (an infinite or NaN window made int() raise)."""
    number = finite_number(value)
    if number is None or isinstance(value, bool):
        return 0
    return int(min(max(number * per_unit, 0.0), float(1 << 62)))


def encode_window(args: dict[str, Any], labels: dict[str, str], time_ns: int) -> bytes:
    """One attribution window (a `host_growth_sites` event's args) as a gzipped pprof profile."""
    profile = _Profile()
    for site in args.get("top_sites") or []:
        if not isinstance(site, dict) or as_int(site.get("size_diff_bytes")) <= 0:
            continue
        locations = [profile.location(file, line, function) for file, line, function in _frames(site)]
        values = [as_int(site.get("size_diff_bytes")), max(0, as_int(site.get("count_diff")))]
        profile.sample(locations, values, {**labels, "thread": str(site.get("thread") or "")})
    duration_ns = _nanoseconds(args.get("window_s"), 1e9)
    comment = f"kvdoctor attribution window {args.get('window_index', '?')} ({args.get('engine', 'tracemalloc')})"
    return gzip.compress(profile.finish(time_ns, duration_ns, comment), mtime=0)


def windows(events: Iterable[schema.Event]) -> Iterator[schema.Event]:
    return (e for e in events if e.name == schema.HOST_GROWTH_SITES and isinstance(e.args, dict))


def profiles_folder(trace_path: str) -> str:
    """Where `run` writes a trace's profiles: beside it, `<trace>.pprof/`."""
    base = trace_path[: -len(".json")] if trace_path.endswith(".json") else trace_path
    return base + ".pprof"


def write_trace_profiles(trace_path: str, processes: dict[int, dict[str, Any]], folder: str, *, force: bool = False) -> list[str]:
    from kvdoctor.trace.reader import iter_events

    return write_profiles(iter_events(trace_path), processes, folder, force=force, inputs=(trace_path,))


def write_profiles(
    events: Iterable[schema.Event],
    processes: dict[int, dict[str, Any]],
    folder: str,
    *,
    force: bool = False,
    inputs: Sequence[str | None] = (),
) -> list[str]:
    """Writes every window as `<folder>/pid<pid>-window<k>.pb.gz` (0600, through the claiming rule
    of kvdoctor/outputs.py: never through a link, over an existing file without `force`, over an
    input, or into a folder another user can write); the paths written."""
    written: list[str] = []
    for event in windows(events):
        info = processes.get(event.pid, {})
        labels = {
            "engine": str(info.get("engine") or ""),
            "version": str(info.get("engine_version") or ""),
            "pid": str(event.pid),
            "title": redact(str(info.get("process_title") or ""))[:120],
        }
        data = encode_window(event.args, labels, _nanoseconds(event.ts, 1000))  # ts: wall-clock µs
        if not written:
            folder = claim_folder(folder, what="pprof folder")
        path = os.path.join(folder, f"pid{event.pid}-window{as_int(event.args.get('window_index'))}.pb.gz")
        if path in written:  # a damaged trace that names one window twice: the first stands
            continue
        written.append(write_private(path, data, force=force, what="pprof profile", inputs=inputs))
    return written
