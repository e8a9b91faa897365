"""Replaying a recorded trace a block of lines at a time, into whatever analyses it.

Counter lines whose shape is known (kvdoctor.trace.blocks) are gathered per (name, pid,
allocator) and handed to the target in bulk (kvdoctor.trace.counter_block), where its sinks parse
only what they keep; every other line is read and fed one event at a time exactly as the reader
gives it. A sink still sees its events in trace order: gathered lines reach it before any other
event it reads (unless it keeps its counter state apart from those), and nothing is held past the
block it was read in.

With a second core, a large trace is read, split into lines and sorted into runs of one shape by
a second interpreter, which hands the blocks over a pipe (so neither side holds more than a
block or two) while this one feeds the target.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import operator
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Generator
from typing import Protocol

import kvdoctor
from kvdoctor.errors import TraceError
from kvdoctor.trace.blocks import BLOCK_BYTES, DIGITS_AS_ZERO, LayoutCache, may_have_leading_zeros, read_line_blocks
from kvdoctor.trace.counter_block import CounterBlock
from kvdoctor.trace.reader import LineDecoder, ReadStats, open_trace, unreadable
from kvdoctor.trace.schema import Event

Label = tuple[bytes, bytes, bytes]


class ReplayTarget(Protocol):
    """What a block replay feeds (an analysis: kvdoctor.analysis.replay routes it to the sinks)."""

    def takes_blocks(self, name: str) -> bool:
        """Whether counter lines named `name` may be gathered and handed over as one block."""
        ...

    def knows_pid(self, pid: int) -> bool:
        """Whether events of `pid` were taken before (processes are taken in order of first appearance)."""
        ...

    def blocks_before(self, name: str) -> frozenset[str] | None:
        """The counter names whose gathered blocks must be handed over before an event `name`
        (None: every name)."""
        ...

    def feed(self, event: Event) -> None: ...

    def feed_block(self, block: CounterBlock) -> None: ...


PARALLEL_MIN_BYTES = 64 << 20  # from this size the reading runs in a second process, beside the detectors

# One block of whole lines as the replay takes it: its bytes; its lines as runs, (line width,
# line count, gatherable) each, a gatherable run being lines of one valid counter shape and one
# (name, pid, allocator); the length of a cut last line at its end (0: none).
Runs = list[tuple[int, int, bool]]
Prepared = tuple[bytes, Runs, int]


def replay_blocks(path: str, target: ReplayTarget, stats: ReadStats, on_block: Callable[[], None] | None = None) -> None:
    """Feeds every event of the trace at `path` to `target`, as `iter_events` would give them.
    A large trace is read and split into runs in a second process when a second core is there."""
    try:
        _replay_file(path, target, stats, on_block)
    except OSError as exc:  # the file's bytes could not be read (an I/O error, a file of /proc)
        raise unreadable(path, exc) from None


def _replay_file(path: str, target: ReplayTarget, stats: ReadStats, on_block: Callable[[], None] | None) -> None:
    gathered = _Gathered(target, stats)
    cache = LayoutCache(lambda layout: target.takes_blocks(layout.name))
    with open_trace(path) as fh:
        stats.bytes_read = fh.tell()
        decoder = LineDecoder(path, stats)
        if _second_core() and os.fstat(fh.fileno()).st_size >= PARALLEL_MIN_BYTES:
            prepared = _prepared_in_second_process(path, fh.tell(), stats)
        else:
            prepare = Preparer()
            prepared = (prepare(block) for block in read_line_blocks(fh, stats))
        with contextlib.closing(prepared):  # a second process ends with the replay, whatever stops it
            for block, runs, tail in prepared:
                if on_block is not None:
                    on_block()
                _replay_runs(block, runs, cache, gathered, decoder)
                gathered.flush()  # nothing is held past its block: memory stays bounded
                if tail:
                    gathered.feed_line(decoder, block[len(block) - tail :], False)
        gathered.flush()
        decoder.finish()


class Preparer:
    """Splits blocks into runs of lines of one shape (digits aside) and tells which runs can be
    gathered whole, parsing only one line of each new shape: the part of a replay that needs
    nothing of the detectors, so a second process can do it."""

    def __init__(self) -> None:
        self.cache = LayoutCache(lambda layout: True)

    def __call__(self, block: bytes) -> Prepared:
        shapes = block.translate(DIGITS_AS_ZERO).split(b"\n")
        tail = len(shapes.pop())
        ends = list(itertools.compress(itertools.count(1), map(operator.ne, shapes, itertools.islice(shapes, 1, None))))
        if shapes:
            ends.append(len(shapes))
        check_digits = may_have_leading_zeros(block)
        known = self.cache.layouts
        runs: Runs = []
        at = start = 0
        for end in ends:
            shape = shapes[start]
            lines = end - start
            start = end
            width = len(shape) + 1
            known_shape = known[shape] if shape in known else self.cache.learn(shape, block[at : at + width - 1])
            if known_shape is None:
                runs.append((width, lines, False))
            elif not check_digits and (lines == 1 or known_shape.one_label(block, at, lines)):
                runs.append((width, lines, True))
            else:  # several processes or allocators, or a digit to check: line by line
                last: tuple[bytes, ...] | None = None
                for line_at in range(at, at + lines * width, width):
                    line = block[line_at : line_at + width - 1]
                    label = known_shape.label(line) if not check_digits or known_shape.digits_ok(line) else None
                    if label is not None and label == last:
                        runs[-1] = (width, runs[-1][1] + 1, True)
                    else:
                        runs.append((width, 1, label is not None))
                    last = label
            at += lines * width
        return block, runs, tail


def _replay_runs(block: bytes, runs: Runs, cache: LayoutCache, gathered: _Gathered, decoder: LineDecoder) -> None:
    """The complete lines of `block`: each gatherable run whose counter the sinks take in bulk is
    gathered whole, every other line is read and fed on its own."""
    known = cache.layouts
    groups = gathered.groups
    at = 0
    for width, lines, gatherable in runs:
        size = lines * width
        known_shape = None
        if gatherable and decoder.seen_header:  # nothing is gathered before the header
            first = block[at : at + width - 1]
            shape = first.translate(DIGITS_AS_ZERO)
            known_shape = known[shape] if shape in known else cache.learn(shape, first)
        if known_shape is None:
            for line_at in range(at, at + size, width):
                gathered.feed_line(decoder, block[line_at : line_at + width - 1], True)
                if decoder.gave_up:
                    decoder.finish()
            at += size
            continue
        label = known_shape.label(first)
        group = groups.get(label)
        if group is None:
            group = gathered.open(label)
        group.add_run(block[at : at + size], known_shape.layout)
        at += size


def _second_core() -> bool:
    return len(os.sched_getaffinity(0)) >= 2 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) >= 2


_HEAD = struct.Struct("<IIQQQ")  # runs, tail, block bytes, bytes read, oversized lines
_READER = "import sys; from kvdoctor.trace.block_replay import send_prepared_blocks; send_prepared_blocks(sys.argv[1], int(sys.argv[2]))"


def _prepared_in_second_process(path: str, offset: int, stats: ReadStats) -> Generator[Prepared, None, None]:
    """`prepare` of every block, done by a second process reading the file from `offset`. The
    pipe between the two holds little, so neither side ever holds more than a block or two."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}  # no probe in the reader, under `kvdoctor run`
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [kvdoctor.PACKAGE_ROOT, env.get("PYTHONPATH")]))
    try:  # a new interpreter, not multiprocessing: nothing of the caller's main module runs again
        reader = subprocess.Popen(
            [sys.executable, "-c", _READER, path, str(offset)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
    except OSError:
        with open(path, "rb") as fh:
            fh.seek(offset)
            prepare = Preparer()
            yield from (prepare(block) for block in read_line_blocks(fh, stats))
        return
    assert reader.stdout is not None and reader.stderr is not None
    for pipe_bytes in (2 * BLOCK_BYTES, BLOCK_BYTES):  # a pipe that holds a block lets the reader run one ahead
        with contextlib.suppress(OSError, AttributeError, ImportError):  # Linux only
            import fcntl

            fcntl.fcntl(reader.stdout.fileno(), fcntl.F_SETPIPE_SZ, pipe_bytes)
            break
    try:
        while True:
            head = reader.stdout.read(_HEAD.size)
            if len(head) < _HEAD.size:
                break
            run_count, tail, size, stats.bytes_read, stats.oversized_lines = _HEAD.unpack(head)
            fields = array.array("Q")
            fields.frombytes(reader.stdout.read(24 * run_count))
            block = reader.stdout.read(size)
            if len(fields) != 3 * run_count or len(block) != size:
                break
            runs = list(zip(fields[::3], fields[1::3], map(bool, fields[2::3]), strict=True))
            yield block, runs, tail
        if reader.wait() != 0:
            why = reader.stderr.read().decode(errors="replace").strip().splitlines()
            raise TraceError(f"{path}: {why[-1] if why else 'the process reading the trace stopped'}")
    finally:
        reader.stdout.close()
        reader.stderr.close()
        if reader.poll() is None:
            reader.kill()  # the replay stopped early
        reader.wait()


def send_prepared_blocks(path: str, offset: int) -> None:
    """The second process of a replay: reads and prepares every block of the trace from `offset`
    and writes each to stdout; a file it cannot read ends it with one line on stderr."""
    stats = ReadStats(bytes_read=offset)
    out = sys.stdout.buffer
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            prepare = Preparer()
            for block in read_line_blocks(fh, stats):
                _, runs, tail = prepare(block)
                fields = array.array("Q", itertools.chain.from_iterable(runs))
                out.write(_HEAD.pack(len(runs), tail, len(block), stats.bytes_read, stats.oversized_lines))
                out.write(fields.tobytes())
                out.write(block)
            out.flush()
    except BrokenPipeError:
        sys.stderr.close()  # the replay stopped early: nothing left to say
    except OSError as exc:
        sys.stderr.write(f"unreadable ({exc.strerror or exc})\n")
        sys.exit(1)


class _Gathered:
    """Counter lines gathered since they were last handed over, one block per (name, pid,
    allocator), handed over in order of first appearance. Sinks keep counter state per (name,
    pid) at most, so within that order is all that matters: a (name, pid) met with a second
    allocator first hands over every block up to its earlier one."""

    def __init__(self, target: ReplayTarget, stats: ReadStats) -> None:
        self.target = target
        self.stats = stats
        self.groups: dict[Label, CounterBlock] = {}
        self._owners: dict[tuple[str, int], Label] = {}
        self._before: dict[str, frozenset[str] | None] = {}

    def open(self, label: Label) -> CounterBlock:
        name, pid = label[0].decode(), int(label[1])
        earlier = self._owners.get((name, pid))
        if earlier is not None:
            self._flush_through(list(self.groups).index(earlier) + 1)
        self._owners[(name, pid)] = label
        block = self.groups[label] = CounterBlock(name, pid, label[2].decode())
        return block

    def feed_line(self, decoder: LineDecoder, line: bytes, complete: bool) -> None:
        """An ordinary line: read in full and fed, after the gathered blocks its sinks also read."""
        event = decoder.decode(line, complete)
        if event is None:
            return
        if self.groups:
            if not self.target.knows_pid(event.pid):
                self.flush()  # processes are admitted in order of first appearance
            else:
                if event.name not in self._before:
                    self._before[event.name] = self.target.blocks_before(event.name)
                names = self._before[event.name]
                last = -1
                for index, block in enumerate(self.groups.values()):
                    if names is None or block.name in names:
                        last = index
                self._flush_through(last + 1)
        self.target.feed(event)

    def flush(self) -> None:
        self._flush_through(len(self.groups))

    def _flush_through(self, count: int) -> None:
        """Hands over the first `count` blocks, in order."""
        if count <= 0:
            return
        handed = list(self.groups.values())[:count] if count < len(self.groups) else list(self.groups.values())
        for block in handed:
            self.stats.events += len(block)
            self.target.feed_block(block)
        if count >= len(self.groups):
            self.groups.clear()
            self._owners.clear()
            return
        for label in list(self.groups)[:count]:
            del self.groups[label]
        for block in handed:
            del self._owners[(block.name, block.pid)]
