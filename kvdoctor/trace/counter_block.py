"""Counter lines of one (name, pid, allocator) gathered by a block replay (kvdoctor.trace.blocks
says how their shapes are learnt), handed to the sinks that take them in bulk: each reads the
column it needs with one pass over the bytes, and parses in full only the few lines it keeps."""

from __future__ import annotations

import bisect
from typing import Any

from kvdoctor.trace.blocks import CounterLayout
from kvdoctor.trace.codec import loads
from kvdoctor.trace.schema import Event


class CounterBlock:
    """Counter lines of one (name, pid, allocator), in trace order, not yet parsed: kept as
    runs of lines of one layout, each run the lines' bytes with their newlines."""

    __slots__ = ("name", "pid", "allocator", "_chunks", "_runs", "_starts", "_count")

    def __init__(self, name: str, pid: int, allocator: str) -> None:
        self.name = name
        self.pid = pid
        self.allocator = allocator
        self._chunks: list[tuple[list[bytes], CounterLayout]] = []  # consecutive runs of one layout, joined when read
        self._runs: list[tuple[bytes, CounterLayout]] | None = None
        self._starts: list[int] = []  # index of each run's first line
        self._count = 0

    def add_run(self, run: bytes, layout: CounterLayout) -> None:
        """Lines of one shape, `layout.width` bytes and a newline each."""
        if self._chunks and self._chunks[-1][1] is layout:
            self._chunks[-1][0].append(run)
        else:
            self._chunks.append(([run], layout))
        self._runs = None
        self._count += len(run) // (layout.width + 1)

    def __len__(self) -> int:
        return self._count

    @property
    def runs(self) -> list[tuple[bytes, CounterLayout]]:
        if self._runs is None:
            self._runs = [(parts[0] if len(parts) == 1 else b"".join(parts), layout) for parts, layout in self._chunks]
            self._starts = []
            start = 0
            for run, layout in self._runs:
                self._starts.append(start)
                start += len(run) // (layout.width + 1)
        return self._runs

    @property
    def layouts(self) -> list[CounterLayout]:
        """The distinct layouts of the block's lines."""
        return list({id(layout): layout for _, layout in self._chunks}.values())

    def line(self, index: int) -> bytes:
        runs = self.runs
        which = bisect.bisect_right(self._starts, index) - 1
        run, layout = runs[which]
        at = (index - self._starts[which]) * (layout.width + 1)
        return run[at : at + layout.width]

    def event(self, index: int) -> Event:
        """Line `index` as the reader would give it (parsed in full: only for the few needed)."""
        line = self.line(index)
        return Event.from_json_dict(loads(line[:-1] if line.endswith(b",") else line))

    def events(self, indices: list[int]) -> list[Event]:
        """`event(i)` for each of `indices`, parsed together."""
        lines = [self.line(index) for index in indices]
        raws = loads(b"[" + b",".join(line[:-1] if line.endswith(b",") else line for line in lines) + b"]")
        assert isinstance(raws, list)
        return [Event.from_json_dict(raw) for raw in raws]

    def timestamps(self) -> list[float]:
        """Every line's `ts`, as `Event.ts` holds it."""
        return self._tokens(None, as_floats=True)

    def floats_where_present(self, key: str) -> list[float | None] | None:
        """float() of argument `key` in every line where it is a number, None in the lines where
        it is absent or a string; None when no line has it as a number."""
        if all(layout.args.get(key, (0, 0, "str"))[2] == "str" for layout in self.layouts):
            return None
        return self._tokens(key, as_floats=True)

    def numbers(self, key: str) -> list[Any] | None:
        """Argument `key` of every line (ints and floats as parsed), or None unless it is a number in all."""
        if any(layout.args.get(key, (0, 0, "str"))[2] == "str" for layout in self.layouts):
            return None
        return self._tokens(key)

    def kind(self, key: str) -> str | None:
        """ "int", "float" or "str" when argument `key` has that kind in every line, else None
        (absent from some, or mixed)."""
        kinds = {layout.args[key][2] if key in layout.args else None for layout in self.layouts}
        return kinds.pop() if len(kinds) == 1 else None

    def last_text(self, key: str) -> str | None:
        """The last non-empty string argument `key` of the block's lines, or None."""
        for run, layout in reversed(self.runs):
            span = layout.args.get(key)
            if span is not None and span[2] == "str" and span[1] - span[0] > 2:  # as long in every line of the run
                last = len(run) - layout.width - 1
                return run[last + span[0] + 1 : last + span[1] - 1].decode()
        return None

    def _tokens(self, key: str | None, *, as_floats: bool = False) -> list[Any]:
        """The tokens of one field (null where a line has it absent or as a string), parsed
        together by the trace's own JSON reader; integers `as_floats` are read as float() has
        them (both round to the nearest double), but for a "-0", which float() makes 0.0."""
        chunks: list[bytes] = []
        for run, layout in self.runs:
            span = (layout.ts.start, layout.ts.stop, layout.ts_kind) if key is None else layout.args.get(key)
            if span is None or span[2] == "str":
                chunks.append(b",".join([b"null"] * (len(run) // (layout.width + 1))))
                continue
            tokens = b",".join(layout.column(run, span[0], span[1]))
            if as_floats and span[2] == "int":
                if b"-0" in tokens:
                    return [None if value is None else float(value) for value in self._tokens(key)]
                tokens = tokens.replace(b",", b".0,") + b".0"
            chunks.append(tokens)
        values = loads(b"[" + b",".join(chunks) + b"]")
        assert isinstance(values, list)
        return values
