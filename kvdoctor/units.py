"""Units in one place: bytes, rates and durations for people, sizes and rates from people,
process titles fit for one line, bounded time series, and numbers from untrusted traces.

Everything a report, a finding message, a live view or a metric label prints goes through here,
so the same quantity reads the same way wherever it appears.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from kvdoctor.errors import KvdoctorError

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
MINUTE_S = 60.0
HOUR_S = 3600.0
DAY_S = 86400.0

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")

# (below this many seconds, divide by, unit, decimals): the first row that fits is used.
# "compact" suits one-line messages and tables; "readable" keeps a decimal where reports have room.
_DURATION_STYLES: dict[str, tuple[tuple[float, float, str, int], ...]] = {
    "compact": ((90.0, 1.0, "s", 0), (90 * MINUTE_S, MINUTE_S, "min", 0), (48 * HOUR_S, HOUR_S, "h", 1), (math.inf, DAY_S, "d", 1)),
    "readable": (
        (10.0, 1.0, "s", 1),
        (120.0, 1.0, "s", 0),
        (2 * HOUR_S, MINUTE_S, "min", 1),
        (3 * DAY_S, HOUR_S, "h", 1),
        (math.inf, DAY_S, "days", 1),
    ),
}


# --------------------------------------------------------------------------- formatting


def format_bytes(n_bytes: float, digits: int | None = None) -> str:
    """Binary units: "1.50 GiB", "320 MiB" (three significant digits), or a fixed number of
    decimals when `digits` is given ("1.5 GiB" with digits=1)."""
    value = float(n_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _BYTE_UNITS:
        if value < 1024 or unit == _BYTE_UNITS[-1]:
            if unit == "B":
                return f"{sign}{value:.0f} B"
            decimals = digits if digits is not None else (2 if value < 10 else 1 if value < 100 else 0)
            return f"{sign}{value:.{decimals}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the last unit always fits")  # pragma: no cover


def format_rate(bytes_per_s: float | None, *, digits: int | None = None, signed: bool = False) -> str:
    """A growth rate per hour ("250 MiB/h"); "—" when unknown. `signed` adds "+" to growth."""
    if bytes_per_s is None:
        return "—"
    text = format_bytes(abs(bytes_per_s) * HOUR_S if signed else bytes_per_s * HOUR_S, digits) + "/h"
    if signed:
        return ("+" if bytes_per_s >= 0 else "-") + text
    return text


def format_optional_bytes(n_bytes: float | None) -> str:
    """`format_bytes`, or "—" for a reading that does not exist (yet)."""
    return "—" if n_bytes is None else format_bytes(n_bytes)


def format_duration(seconds: float | None, style: str = "compact") -> str:
    """ "45 s", "12 min", "3.2 h", "4.1 d" (compact) or "12.5 min", "4.1 days" (readable);
    "never" for None, as a time to OOM that will not come."""
    if seconds is None:
        return "never"
    seconds = float(seconds)
    if seconds < 0:
        return "-" + format_duration(-seconds, style)
    rows = _DURATION_STYLES[style]
    for below_s, scale_s, unit, decimals in rows:
        if seconds < below_s or below_s == math.inf:  # the last row takes the rest (NaN included)
            return f"{seconds / scale_s:.{decimals}f} {unit}"
    raise AssertionError("unreachable: the last row always fits")  # pragma: no cover


# --------------------------------------------------------------------------- parsing

# Binary units (KiB, MiB, ...) are powers of 1024; SI units (KB, MB, ...) powers of 1000; a bare
# K, M, G, T is binary, as in most memory settings. Case does not matter.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": KIB,
    "kib": KIB,
    "kb": 1000,
    "m": MIB,
    "mib": MIB,
    "mb": 1000**2,
    "g": GIB,
    "gib": GIB,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_TIME_UNITS = {
    "ms": 0.001,
    "msec": 0.001,
    "millisecond": 0.001,
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "m": MINUTE_S,
    "min": MINUTE_S,
    "minute": MINUTE_S,
    "h": HOUR_S,
    "hr": HOUR_S,
    "hour": HOUR_S,
    "d": DAY_S,
    "day": DAY_S,
}
MAX_SIZE_BYTES = float(1 << 62)
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """ "500MiB", "1.5GiB", "10GB", "0" -> bytes."""
    match = _SIZE_RE.match(str(text))
    if not match:
        raise KvdoctorError(f"unreadable size {text!r}", "write a number and a unit, e.g. 500MiB, 1.5GiB, 10GB")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _SIZE_UNITS:
        raise KvdoctorError(f"unknown size unit {match.group(2)!r} in {text!r}", "use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    size = number * _SIZE_UNITS[unit]
    if not math.isfinite(size) or size >= MAX_SIZE_BYTES:
        raise KvdoctorError(f"size {text!r} is beyond any machine's memory", "write a size below 4 EiB, e.g. 500MiB")
    return int(round(size))


def parse_rate(text: str) -> float:
    """ "500MiB/h", "10MB/s", "1GiB/hour" -> bytes per second."""
    size_text, slash, per = str(text).partition("/")
    if not slash:
        raise KvdoctorError(f"unreadable rate {text!r}", "write a size per time, e.g. 500MiB/h, 10MB/s, 1GiB/hour")
    per = per.strip().lower()
    unit = per[:-1] if per.endswith("s") and len(per) >= 3 and per[:-1] in _TIME_UNITS else per  # "hours", "mins", not "ms"
    if unit not in _TIME_UNITS:
        raise KvdoctorError(f"unknown time unit {per!r} in {text!r}", "use /ms, /s, /min, /h or /day")
    return parse_size(size_text) / _TIME_UNITS[unit]


# --------------------------------------------------------------------------- process titles


def short_title(title: str, limit: int | None = None) -> str:
    """A process title fit for one line: whitespace collapsed, the program's path cut to its name
    (`/usr/bin/python3 -m sglang...` -> `python3 -m sglang...`, also after a leading `kvdoctor`),
    cut at `limit` with "…" after the last whole word that fits (mid-word only where none does)."""
    words = title.split()
    first = 1 if len(words) > 1 and words[0] == "kvdoctor" else 0
    if len(words) > first and "/" in words[first] and "::" not in words[first]:
        words[first] = words[first].rsplit("/", 1)[-1]
    text = " ".join(words)
    if limit is None or len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 1)
    return text[:cut] + " …" if cut >= limit // 2 else text[: limit - 1] + "…"


# --------------------------------------------------------------------------- bounded series

T = TypeVar("T")


class BoundedSeries(Generic[T]):
    """A series that never holds more than `max_points`: when full it drops every other point
    and from then on keeps every 2nd (then 4th, ...) new one, so the points kept stay on an even
    grid and a watch of days costs the same memory as one of minutes. A replay feeds it in runs
    (`add_from`, `extend`): most points are thinned away, so they are only counted, and only the
    ones kept (the same ones `add` one by one keeps) are built or copied."""

    __slots__ = ("times", "values", "stride", "_seen", "max_points")

    def __init__(self, max_points: int) -> None:
        self.times: list[float] = []
        self.values: list[T] = []
        self.stride = 1
        self._seen = 0
        self.max_points = max_points

    def add(self, t: float, value: T) -> None:
        seen = self._seen
        self._seen = seen + 1
        if seen % self.stride:
            return
        self.times.append(t)
        self.values.append(value)
        if len(self.times) > self.max_points:
            self.times = self.times[::2]
            self.values = self.values[::2]
            self.stride *= 2

    def __len__(self) -> int:
        return len(self.times)

    def add_from(self, count: int, points_at: Callable[[list[int]], list[tuple[float, T]]]) -> None:
        """The same as `add(*point)` for the points at 0 .. count-1, in order: `points_at` is asked
        once, for the indices of the points the series keeps."""
        seen, stride, length, index = self._seen, self.stride, len(self.times), 0
        kept: list[int] = []
        while True:
            skip = -seen % stride
            if index + skip >= count:
                break
            index += skip + 1
            seen += skip + 1
            kept.append(index - 1)
            length += 1
            if length > self.max_points:
                length, stride = (length + 1) // 2, stride * 2
        base = self._seen
        for at, point in zip(kept, points_at(kept) if kept else [], strict=True):
            self._seen = base + at
            self.add(*point)
        self._seen = base + count

    def extend(self, times: Sequence[float], values: Sequence[T]) -> None:
        """The same as `add(times[i], values[i])` for every i, in order: the kept points are
        copied a slice at a time, up to the next thinning."""
        count = len(times)
        index = 0
        while True:
            stride = self.stride
            skip = -self._seen % stride
            if index + skip >= count:
                self._seen += count - index
                return
            index += skip
            self._seen += skip
            room = self.max_points + 1 - len(self.times)  # points kept before the next thinning
            take = min(room, (count - index + stride - 1) // stride)
            stop = index + (take - 1) * stride + 1
            self.times.extend(times[index:stop:stride])
            self.values.extend(values[index:stop:stride])
            self._seen += stop - index
            index = stop
            if len(self.times) > self.max_points:
                self.times = self.times[::2]
                self.values = self.values[::2]
                self.stride *= 2


# --------------------------------------------------------------------------- numbers from traces
# A trace may come from anywhere (a newer kvdoctor, a hand edit, a crash): every number read from
# one goes through these, so a string, a bool or a NaN never takes an analysis down.

_EXACT_INT_LIMIT = 1 << 62


def as_int(value: Any, default: int = 0) -> int:
    """int(value), or `default` when it has no integer reading."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return default


def as_count(value: Any) -> int:
    """A count: a non-negative int, 0 when unreadable."""
    return max(0, as_int(value))


def as_float(value: Any) -> float | None:
    """float(value) when finite (numeric strings included), else None."""
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if math.isfinite(out) else None


def finite_number(value: Any) -> float | None:
    """A measured quantity: a real int or float (not a bool, not a string), finite, and for ints
    within ±2**62; else None."""
    kind = type(value)
    if kind is int:
        return float(value) if -_EXACT_INT_LIMIT < value < _EXACT_INT_LIMIT else None
    if kind is not float:
        return None
    return value if math.isfinite(value) else None
