"""`BoundedSeries` that can take a run of points at once, building only the points it keeps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from kvdoctor.units import BoundedSeries

T = TypeVar("T")


class ThinnedSeries(BoundedSeries[T]):
    """A bounded series fed in runs: a long replay thins most points away, so they are only
    counted, and only the ones kept (the same ones `add` one by one keeps) are built or copied."""

    __slots__ = ()

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
