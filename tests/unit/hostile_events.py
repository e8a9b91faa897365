"""Hostile trace events and trace damage built from one seed: the reader fuzz's value tables and
plain-Python generators over them.

Hypothesis drawing a list of nested events value by value cost about 100 ms an input, fourteen
times what the reader and the detectors then spend on it. The properties draw one seed instead
and build the input with `random.Random(seed)` here, so the seed Hypothesis prints for a failure
rebuilds the same input: `events(random.Random(seed))`. The generators keep Hypothesis's habits
that find bugs: boundaries, small and 64-bit-edge integers beside huge ones, NaN and infinities,
control and astral characters, empty and full-length collections.
"""

from __future__ import annotations

import ast
import copy
import glob
import math
import os
import random
import struct
from collections.abc import Callable
from typing import Any

from kvdoctor.trace import schema

JUNK_STRINGS = (
    "NaN",
    "nan",
    "inf",
    "-inf",
    "Infinity",
    "1e400",
    "-1",
    "10**30",
    "",
    " ",
    "\x00",
    "\ud7ff",
    "null",
    "[]",
    "{}",
    "é",
    "9" * 5000,
)
HUGE_INTS = (10**30, -(10**30), 2**64, -(2**63) - 1, 0, -1, -5)
COUNT_TABLE = (10**30, -(10**30), -1, 0, 3)
NASTY_FLOATS = (
    0.0,
    -0.0,
    float("nan"),
    -float("nan"),
    float("inf"),
    -float("inf"),
    5e-324,
    -5e-324,
    2.2250738585072014e-308,
    1.7976931348623157e308,
    -1.7976931348623157e308,
    1.0,
    -1.0,
    0.5,
    1.1,
    1 / 3,
    1e-7,
    1e16,
    2.0**53,
    2.0**53 + 2,
    2.0**63,
    2.0**64,
    -(2.0**63),
    3.402823466e38,
    2.220446049250313e-16,
)
ARG_KEYS = (
    "kind",
    "count",
    "slot_ids",
    "allocator",
    "site",
    "requests",
    "sites",
    "allocated_at",
    "orphan_slots",
    "orphan_slot_ids",
    "orphan_allocated_at",
    "orphan_requests",
    "reason",
    "idle",
    "free_slots",
    "tree_slots",
    "total_slots",
    "tree_holds_free_slot_ids",
    "tree_freed_slots",
    "ledger_disagrees_slots",
    "state",
    "dropped_events",
    "write_error",
    "fix",
    "name",
    "rss",
)
KINDS = schema.VIOLATION_KINDS + (schema.ORPHAN_SLOTS, schema.TREE_HOLDS_FREE_SLOT)
STATES = ("off", "partial", "on", "idle", "exit")
GROUP_KEYS = ("kind", "allocator", "site")  # what makes two violations one finding
DETECTED_NAMES = (schema.VIOLATION, schema.VIOLATION, schema.CENSUS)  # most detectors read violations
EVENT_NAMES = (
    schema.VIOLATION,
    schema.CENSUS,
    schema.PROBE_STATUS,
    schema.PROBE_STATS,
    schema.LEDGER_COUNTER,
    schema.MEMORY_COUNTER,
    schema.FIX_APPLIED,
    schema.FINDING,
    schema.PROCESS_NAME,
    schema.TRACE_END,
)
PHASES = ("M", "C", "i", "X", "B")
CATEGORIES = ("", schema.CAT_PROBE, schema.CAT_SAMPLER)
INT64 = (-(2**63), 2**63 - 1)
# bytes a JSON-lines reader trips on
SHARP_BYTES = b'\x00\xff\xfe\xed\xc0\x80\n\r\t {}[]",:\\0123456789-+.eEnNaI'
# a few characters a JSON text reader trips on, beside the random ones
SHARP_CHARS = '"\\\n\r\t\x00\x7f\x85\u2028\u2029\ufeff\ufffd\U0010ffff'


def source_constants() -> dict[type, tuple[Any, ...]]:
    """The literals in the reader's and the detectors' source (event names, arg keys, limits),
    filtered as Hypothesis filters the constants it mixes into its draws: an input that speaks
    the code's own words gets past its first checks."""
    found: dict[type, set[Any]] = {int: set(), float: set(), str: set(), bytes: set()}
    files = sorted(
        glob.glob(os.path.join(PACKAGE, "trace", "*.py")) + glob.glob(os.path.join(PACKAGE, "analysis", "**", "*.py"), recursive=True)
    )
    for path in files:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                continue
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
                value = node.operand.value
                value = -value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
            elif isinstance(node, ast.Constant):
                value = node.value
            else:
                continue
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, str) and (not value.strip() or len(value) > 20):
                continue
            if isinstance(value, bytes) and (not value or len(value) > 50):
                continue
            if isinstance(value, int) and -100 < value < 100:
                continue
            if isinstance(value, float) and (math.isinf(value) or value == 0.0):
                continue
            if type(value) in found:
                found[type(value)].add(value)
    return {kind: tuple(sorted(values, key=repr)) for kind, values in found.items()}


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(schema.__file__)))  # the kvdoctor under test
CONSTANTS = source_constants()


def one_of(rng: random.Random, *choices: Callable[[random.Random], Any]) -> Any:
    return rng.choice(choices)(rng)


def constant(rng: random.Random, kind: type, fits: Callable[[Any], bool]) -> Any:
    """One of the source's literals of this type that fits, or None."""
    choices = [value for value in CONSTANTS[kind] if fits(value)]
    return rng.choice(choices) if choices else None


def integer(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high], shaped like Hypothesis's: small values most often, a heavy tail
    of every width clamped to the bounds (so the bounds come often), now and then a bound's
    neighbour or a literal from the source."""
    roll = rng.random()
    if roll < 0.05:
        value = constant(rng, int, lambda v: low <= v <= high)
        if value is not None:
            return int(value)
    if roll < 0.15:
        return rng.choice((low, high, min(low + 1, high), max(high - 1, low)))
    if roll < 0.55:
        return max(low, min(high, rng.randint(-256, 256)))
    value = rng.getrandbits(rng.randint(1, 130))
    return max(low, min(high, -value if rng.random() < 0.5 else value))


def position(rng: random.Random, length: int) -> int:
    """An offset in [0, length]: near the start or the end as often as anywhere between."""
    return integer(rng, 0, length) if rng.random() < 0.5 else rng.randint(0, length)


def size(rng: random.Random, max_size: int, min_size: int = 0) -> int:
    """A collection size as Hypothesis draws it: geometric around min(min+5, the midpoint), so
    empty is common and full happens."""
    average = min(max(min_size * 2, min_size + 5), 0.5 * (min_size + max_size)) - min_size
    keep_going = average / (average + 1)
    n = min_size
    while n < max_size and rng.random() < keep_going:
        n += 1
    return n


SIGNALING_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000001))[0]


def floating(rng: random.Random) -> float:
    """Any float: a nasty constant (NaN, signalling NaN, the infinities, -0.0, subnormals), a
    literal from the source, an integral value, or any bit pattern (NaN payloads included)."""
    roll = rng.random()
    if roll < 0.05:
        value = constant(rng, float, lambda v: True)
        if value is not None:
            return float(value)
    if roll < 0.25:
        return float(rng.choice((*NASTY_FLOATS, SIGNALING_NAN, -SIGNALING_NAN)))
    if roll < 0.5:
        return float(integer(rng, -(2**70), 2**70))
    if roll < 0.6:
        return rng.uniform(-1e6, 1e6)
    return float(struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0])


def character(rng: random.Random) -> str:
    """Any character but a surrogate (as Hypothesis's text() draws), ASCII most often."""
    roll = rng.random()
    if roll < 0.45:
        return chr(rng.randint(32, 126))
    if roll < 0.55:
        return chr(rng.choice((*range(32), 127)))
    if roll < 0.65:
        return rng.choice(SHARP_CHARS)
    if roll < 0.75:
        return chr(rng.randint(128, 0x2FF))
    if roll < 0.85:
        code = rng.randint(0x300, 0xFFFF - 0x800)
        return chr(code if code < 0xD800 else code + 0x800)  # skips the surrogates
    return chr(rng.randint(0x10000, 0x10FFFF))


def text(rng: random.Random, max_size: int) -> str:
    if rng.random() < 0.05:
        value = constant(rng, str, lambda v: len(v) <= max_size)
        if value is not None:
            return str(value)
    return "".join(character(rng) for _ in range(size(rng, max_size)))


def binary(rng: random.Random, max_size: int, min_size: int = 0) -> bytes:
    if rng.random() < 0.05:
        value = constant(rng, bytes, lambda v: min_size <= len(v) <= max_size)
        if value is not None:
            return bytes(value)
    n = size(rng, max_size, min_size)
    if rng.random() < 0.5:
        return rng.randbytes(n)
    return bytes(rng.choice(SHARP_BYTES) for _ in range(n))


def scalar(rng: random.Random) -> Any:
    return one_of(
        rng,
        lambda r: None,
        lambda r: r.random() < 0.5,
        lambda r: integer(r, -(2**63), 2**64 - 1),
        lambda r: r.choice(HUGE_INTS),
        floating,
        lambda r: text(r, 12),
        lambda r: r.choice(JUNK_STRINGS),
    )


def junk(rng: random.Random, leaves: list[int] | None = None) -> Any:
    """Any JSON-able value, nested lists and dicts of scalars with at most six leaves."""
    leaves = [6] if leaves is None else leaves
    if leaves[0] <= 1 or rng.random() < 0.4:
        leaves[0] -= 1
        return scalar(rng)
    n = size(rng, 3)
    if rng.random() < 0.5:
        items = []
        for _ in range(n):
            if leaves[0] > 0:
                items.append(junk(rng, leaves))
        return items
    out = {}
    for _ in range(n):
        if leaves[0] > 0:
            out[text(rng, 4)] = junk(rng, leaves)
    return out


def count_value(rng: random.Random) -> Any:
    return one_of(rng, lambda r: integer(r, -(2**63), 2**63), lambda r: r.choice(COUNT_TABLE), lambda r: r.choice(JUNK_STRINGS))


def arg_value(rng: random.Random) -> Any:
    return one_of(
        rng,
        count_value,
        lambda r: [integer(r, -(2**63), 2**63) for _ in range(size(r, 10))],  # slot ids
        lambda r: {text(r, 5): count_value(r) for _ in range(size(r, 3))},  # requests / sites -> counts
        lambda r: r.choice(STATES),
        junk,
    )


def args(rng: random.Random) -> dict[str, Any]:
    """Args shaped like the probe's (a kind, counts, id lists, site->count maps), values hostile."""
    kind = {} if rng.random() < 0.5 else {"kind": one_of(rng, lambda r: r.choice(KINDS), junk)}
    rest = {}
    for _ in range(size(rng, 5)):
        key = rng.choice(ARG_KEYS) if rng.random() < 0.5 else text(rng, 4)
        rest[key] = arg_value(rng)
    return {**rest, **kind}


def name(rng: random.Random) -> str:
    return one_of(rng, lambda r: r.choice(DETECTED_NAMES), lambda r: r.choice(EVENT_NAMES), lambda r: text(r, 8))


def event(rng: random.Random) -> schema.Event:
    return schema.Event(
        ph=one_of(rng, lambda r: r.choice(PHASES), lambda r: text(r, 2)),
        name=name(rng),
        pid=one_of(rng, lambda r: r.choice((1, 2)), lambda r: integer(r, *INT64), lambda r: r.choice((1, 2, 10**30))),
        ts=floating(rng),
        cat=rng.choice(CATEGORIES),
        tid=integer(rng, 0, 2**31),
        args=args(rng),
    )


def events(rng: random.Random, max_size: int = 8) -> list[schema.Event]:
    """Up to `max_size` events; now and then one repeats an earlier one, whole or as the same
    group (name, pid, kind, allocator, site) with fresh values, as Hypothesis's copying of spans
    did and as a probe repeats a violation at one call site."""
    count = max_size if rng.random() < 0.1 else rng.randint(0, max_size)
    out: list[schema.Event] = []
    for _ in range(count):
        if out and rng.random() < 0.1:
            earlier = copy.deepcopy(rng.choice(out))
            if rng.random() < 0.5:
                fresh = args(rng)
                fresh.update({k: v for k, v in earlier.args.items() if k in GROUP_KEYS})
                earlier.args, earlier.ts = fresh, floating(rng)
            out.append(earlier)
        else:
            out.append(event(rng))
    return out


def clean_events(rng: random.Random) -> list[schema.Event]:
    """Events the writer encodes as one readable line each (no headers in the middle)."""
    out = events(rng)
    for item in out:
        if item.name in (schema.HEADER, schema.RUN_HEADER):
            item.name = schema.CENSUS
    return out


def unreadable_lines(rng: random.Random) -> list[bytes]:
    """Up to three lines of junk bytes (no newline in them) to put before a header."""
    lines = []
    for _ in range(size(rng, 3)):
        line = binary(rng, 20, min_size=1)
        while b"\n" in line:
            line = binary(rng, 20, min_size=1)
        lines.append(line)
    return lines


def mutate(data: bytes, rng: random.Random) -> bytes:
    """Applies a few random damages: truncation, flipped bytes, lines duplicated/removed/swapped."""
    for _ in range(rng.randint(0, 4)):
        op = rng.choice(("truncate", "flip", "dup", "drop", "swap", "insert"))
        if not data:
            break
        if op == "truncate":
            data = data[: position(rng, len(data))]
        elif op == "flip":
            pos = position(rng, len(data) - 1)
            data = data[:pos] + bytes([integer(rng, 0, 255)]) + data[pos + 1 :]
        elif op == "insert":
            pos = position(rng, len(data))
            data = data[:pos] + binary(rng, 16, min_size=1) + data[pos:]
        else:
            lines = data.split(b"\n")
            i = position(rng, len(lines) - 1)
            if op == "dup":
                lines.insert(i, lines[i])
            elif op == "drop":
                del lines[i]
            else:
                j = position(rng, len(lines) - 1)
                lines[i], lines[j] = lines[j], lines[i]
            data = b"\n".join(lines)
    return data
