"""Reading a trace a block of lines at a time, and recognising counter lines without parsing them.

A long trace is mostly counter lines that differ from each other only in their digits. Mapping
every digit to `0` gives a line's *shape*; a shape is checked once (a real parse, plus a scan
that finds where each field sits) and every later line of that shape is then known to be valid
JSON with the same keys in the same places, as long as none of its multi-digit numbers starts
with a zero (the one digit rule of JSON, checked per block, and per line where a block may have
one). Lines of one shape have one length, so a run of them is kept as one bytes object and a
field of every line is read with one `struct` pass; such lines are counted and thinned without
building a dict per line (kvdoctor.trace.counter_block). Everything else goes through the ordinary
reader.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import struct
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from kvdoctor.trace.codec import loads
from kvdoctor.trace.reader import MAX_LINE_BYTES, ReadStats

BLOCK_BYTES = 1 << 20  # read size: memory stays bounded whatever the trace's length
MAX_LAYOUTS = 4096  # shapes remembered; a trace with more just reads the rest line by line
MAX_SHAPE_BYTES = 4096  # longer lines are read one by one: their shapes are not worth remembering

DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
# In a line of a learnt shape every number follows a colon (or a colon and a minus): a block
# where neither ":0" nor "-0" is followed by a digit has no number with a leading zero, and its
# lines skip the per-line check. Two searches for a literal start are the fastest test.
_COLON_ZERO_DIGIT = re.compile(rb":0[0-9]")
_MINUS_ZERO_DIGIT = re.compile(rb"-0[0-9]")


def may_have_leading_zeros(block: bytes) -> bool:
    """False when no number in the block's learnt-shape lines can start with a zero."""
    if _COLON_ZERO_DIGIT.search(block) is not None:
        return True
    return b"-" in block and _MINUS_ZERO_DIGIT.search(block) is not None


_NUMBER_CHARS = frozenset(b"-0.")
_MAX_INT_DIGITS = 18  # below 2**62: every reader of the trace takes such an integer as it is
_MAX_NUMBER_CHARS = 24  # no exponent and at most this long: a float that is always finite
_ZERO = ord("0")


def read_line_blocks(fh: BinaryIO, stats: ReadStats, block_bytes: int | None = None) -> Iterator[bytes]:
    """Blocks of whole lines (each ending in a newline, but for a cut last line at the end of the
    file), with the same limit on a line's length as the line reader: over-long lines are
    counted and skipped, and no block holds more than about `block_bytes + MAX_LINE_BYTES`."""
    limit = MAX_LINE_BYTES
    size = max(1, min(block_bytes or BLOCK_BYTES, limit))  # a line inside one read is never over the limit
    pending = b""
    oversized = False
    while True:
        data = fh.read(size)
        if not data:
            break
        if oversized:
            end = data.find(b"\n")
            if end < 0:
                stats.bytes_read += len(data)
                continue
            stats.bytes_read += end + 1
            data = data[end + 1 :]
            oversized = False
        if pending:
            data = pending + data
            first_end = data.find(b"\n", len(pending))
            if first_end > limit:  # the line begun in earlier reads ends here, too long
                stats.oversized_lines += 1
                stats.bytes_read += first_end + 1
                data = data[first_end + 1 :]
        cut = data.rfind(b"\n") + 1
        pending = data[cut:]
        if len(pending) > limit:
            stats.oversized_lines += 1
            stats.bytes_read += len(pending)
            pending, oversized = b"", True
        if cut:
            stats.bytes_read += cut
            yield data[:cut]
    if pending:
        stats.bytes_read += len(pending)
        yield pending


@dataclasses.dataclass(frozen=True)
class CounterLayout:
    """Where the fields of one shape of counter line sit: slices into the line's bytes. Every
    line of a shape has the same length, `width` (a trailing comma included).

    `args` maps each argument to (start, end, kind), kind being "int", "float" or "str".
    """

    name: str
    name_span: slice
    pid: slice
    ts: slice
    args: dict[str, tuple[int, int, str]]
    allocator: slice | None
    leading_digits: tuple[int, ...]  # where each multi-digit number starts: never a zero
    width: int
    ts_kind: str = "float"
    _columns: dict[tuple[int, int], struct.Struct] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def label_of(self) -> Callable[[bytes], tuple[bytes, bytes, bytes]]:
        """The (name, pid, allocator) bytes of a line of this shape, in one call."""
        return operator.itemgetter(self.name_span, self.pid, self.allocator or slice(0, 0))

    def column(self, run: bytes, start: int, end: int) -> Iterator[bytes]:
        """Bytes `start:end` of every line of a run of lines of this shape."""
        reader = self._columns.get((start, end))
        if reader is None:
            reader = self._columns[(start, end)] = struct.Struct(f"{start}x{end - start}s{self.width + 1 - end}x")
        return map(_FIRST, reader.iter_unpack(run))

    def digits_ok(self) -> Callable[[bytes], bool]:
        """A check that a line of this shape has no number with a leading zero."""
        positions = self.leading_digits
        if not positions:
            return lambda line: True
        if len(positions) == 1:
            (position,) = positions
            return lambda line: line[position] != _ZERO
        pick = operator.itemgetter(*positions)
        return lambda line: _ZERO not in pick(line)


_FIRST = operator.itemgetter(0)


def learn_layout(line: bytes) -> CounterLayout | None:
    """The layout of a compact counter line (`{"ph":"C","name":...,"args":{...}}` with an
    optional trailing comma), or None for any line the fast path should not take."""
    text = line[:-1] if line.endswith(b",") else line
    if not text.startswith(b"{") or b"\\" in text:
        return None
    try:
        raw = loads(text)
    except (ValueError, TypeError, RecursionError):
        return None
    if not isinstance(raw, dict) or raw.get("ph") != "C" or not isinstance(raw.get("args"), dict):
        return None
    scanned = _scan_object(text, 0, nested=True)
    if scanned is None or scanned[1] != len(text):
        return None
    fields = scanned[0]
    name, pid, ts, args = fields.get("name"), fields.get("pid"), fields.get("ts"), fields.get("args")
    if name is None or name[2] != "str" or pid is None or pid[2] != "int" or ts is None or ts[2] not in ("int", "float"):
        return None
    if not isinstance(args, dict) or any(kind not in ("int", "float", "str") for _, _, kind in _spans(fields)):
        return None
    name_text = text[name[0] + 1 : name[1] - 1].decode()
    if any(ch.isdigit() for ch in name_text):
        return None
    allocator = args.get("allocator")
    if allocator is not None and allocator[2] != "str":
        return None
    leading = tuple(
        start + (text[start] == ord("-")) for start, end, kind in _spans(fields) if kind != "str" and _int_digits(text, start, end) > 1
    )
    return CounterLayout(
        name=name_text,
        name_span=slice(name[0] + 1, name[1] - 1),
        pid=slice(pid[0], pid[1]),
        ts=slice(ts[0], ts[1]),
        args={key: span for key, span in args.items() if isinstance(span, tuple)},
        allocator=slice(allocator[0] + 1, allocator[1] - 1) if allocator is not None else None,
        leading_digits=leading,
        width=len(line),
        ts_kind=ts[2],
    )


Span = tuple[int, int, str]


def _spans(fields: dict[str, Any]) -> Iterator[Span]:
    for value in fields.values():
        if isinstance(value, dict):
            yield from _spans(value)
        else:
            yield value


def _int_digits(text: bytes, start: int, end: int) -> int:
    token = text[start:end].lstrip(b"-")
    dot = token.find(b".")
    return len(token) if dot < 0 else dot


def _scan_object(text: bytes, at: int, *, nested: bool) -> tuple[dict[str, Any], int] | None:
    """Scans `{"key":value,...}` from `at`: values are plain strings and numbers (and, when
    `nested`, one level of object under "args"). Keys must be distinct and free of digits, so
    every line of the same shape has exactly these keys."""
    if text[at : at + 1] != b"{":
        return None
    at += 1
    fields: dict[str, Any] = {}
    if text[at : at + 1] == b"}":
        return fields, at + 1
    while True:
        key_span = _scan_string(text, at)
        if key_span is None or text[key_span : key_span + 1] != b":":
            return None
        key = text[at + 1 : key_span - 1].decode()
        if key in fields or any(ch.isdigit() for ch in key):
            return None
        at = key_span + 1
        if nested and key == "args":
            inner = _scan_object(text, at, nested=False)
            if inner is None:
                return None
            fields[key], at = inner
        else:
            value = _scan_value(text, at)
            if value is None:
                return None
            fields[key] = value
            at = value[1]
        following = text[at : at + 1]
        if following == b"}":
            return fields, at + 1
        if following != b",":
            return None
        at += 1


def _scan_string(text: bytes, at: int) -> int | None:
    """End of a printable-ASCII string without escapes starting at `at`, or None."""
    if text[at : at + 1] != b'"':
        return None
    end = text.find(b'"', at + 1)
    if end < 0 or any(ch < 0x20 or ch > 0x7E for ch in text[at + 1 : end]):
        return None
    return end + 1


def _scan_value(text: bytes, at: int) -> Span | None:
    if text[at : at + 1] == b'"':
        end = _scan_string(text, at)
        return None if end is None else (at, end, "str")
    end = at
    while end < len(text) and (text[end] in _NUMBER_CHARS or 0x30 <= text[end] <= 0x39):
        end += 1
    token = text[at:end]
    if not token or len(token) > _MAX_NUMBER_CHARS:
        return None
    digits = token.lstrip(b"-")
    if token.count(b"-") > 1 or (token.startswith(b"-") is False and b"-" in token) or not digits[:1].isdigit():
        return None
    if b"." in digits:
        whole, _, fraction = digits.partition(b".")
        return (at, end, "float") if whole.isdigit() and fraction.isdigit() else None
    return (at, end, "int") if digits.isdigit() and len(digits) <= _MAX_INT_DIGITS else None


class KnownShape:
    """A learnt shape: its layout, its per-line digit check, and its (name, pid, allocator)
    reader, with a test that a run of lines has one (name, pid, allocator)."""

    __slots__ = ("layout", "digits_ok", "label", "_pid_end", "_allocator")

    def __init__(self, layout: CounterLayout, line: bytes) -> None:
        self.layout = layout
        self.digits_ok = layout.digits_ok()
        self.label = layout.label_of()
        self._pid_end = layout.pid.stop + 1
        args_at = line.find(b'"args":{')  # once per line: no string of a known shape holds a quote
        self._allocator = (args_at, layout.allocator.stop + 1) if layout.allocator is not None else None

    def one_label(self, block: bytes, at: int, lines: int) -> bool:
        """True when every line of the run of `lines` lines from `at` in `block` has the first
        line's pid and allocator, tested with two searches: the line's start up to its pid after
        every newline, and the args from their opening up to the allocator (both unique in a
        line). False may also mean "not known"."""
        first = block[at : at + self.layout.width]
        end = at + lines * (self.layout.width + 1)
        if block.count(b"\n" + first[: self._pid_end], at, end) != lines - 1:
            return False
        if self._allocator is None:
            return True
        start, stop = self._allocator
        return block.count(first[start:stop], at, end) == lines


class LayoutCache:
    """Shapes seen so far and their layouts (None: not a fast line), bounded in size: once full,
    or for a line too long to be worth it, a new shape is read line by line without learning."""

    def __init__(self, accept: Callable[[CounterLayout], bool]) -> None:
        self._accept = accept
        self.layouts: dict[bytes, KnownShape | None] = {}

    def learn(self, shape: bytes, line: bytes) -> KnownShape | None:
        if len(self.layouts) >= MAX_LAYOUTS or len(line) > MAX_SHAPE_BYTES:
            return None
        layout = learn_layout(line)
        entry = KnownShape(layout, line) if layout is not None and self._accept(layout) else None
        self.layouts[shape] = entry
        return entry
