"""A recorded trace through every detector: `analyze_trace`, and the routing of the block replay
(kvdoctor.trace.block_replay) onto the analyzer's sinks.

The block replay hands over the counter lines of one (name, pid, allocator) at a time; here they
go to the sinks that take them in bulk (kvdoctor.analysis.detectors.base.CounterBlockSink), after
the same admission of processes as `Analyzer.feed_all`, so a replay and a line-by-line analysis
of one trace end in the same `Analysis`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from kvdoctor.analysis.admission import COUNTED, level_of_block
from kvdoctor.analysis.analyzer import READ_BY_ANALYZER, Analysis, Analyzer
from kvdoctor.analysis.detectors.base import CounterBlockSink, reads
from kvdoctor.analysis.growth import GrowthParams
from kvdoctor.trace.block_replay import replay_blocks
from kvdoctor.trace.counter_block import CounterBlock
from kvdoctor.trace.reader import ReadStats

PROGRESS_BAR_MIN_BYTES = 64 * 1024 * 1024  # smaller traces replay too fast to need a bar

BlockFeeds = list[Callable[[CounterBlock], None]]


class AnalyzerTarget:
    """An `Analyzer` as the block replay's target (kvdoctor.trace.block_replay.ReplayTarget)."""

    def __init__(self, analyzer: Analyzer) -> None:
        self.analyzer = analyzer
        self.feed = analyzer.feed
        self._feeds: dict[str, BlockFeeds | None] = {}

    def _block_feeds(self, name: str) -> BlockFeeds | None:
        if name not in self._feeds:
            self._feeds[name] = None if name in READ_BY_ANALYZER else self._bulk_feeds_of(name)
        return self._feeds[name]

    def _bulk_feeds_of(self, name: str) -> BlockFeeds | None:
        """The bulk feeds of every sink that reads counter `name`, or None when one of them
        takes events only one at a time (its lines then go through `feed`)."""
        feeds: BlockFeeds = []
        for sink in self.analyzer.sinks:
            if reads(sink, name):
                if not isinstance(sink, CounterBlockSink):
                    return None
                feeds.append(sink.feed_counter_block)
        return feeds

    def takes_blocks(self, name: str) -> bool:
        return self._block_feeds(name) is not None

    def knows_pid(self, pid: int) -> bool:
        return pid in self.analyzer.admission.levels

    def blocks_before(self, name: str) -> frozenset[str] | None:
        """The counter names whose gathered blocks must be fed before an event `name`: those a
        sink reads along with `name`, unless that sink keeps its counter state apart from what
        other events change (`counter_state_apart`). None: every name."""
        names: set[str] = set()
        for sink in self.analyzer.sinks:
            if not reads(sink, name):
                continue
            consumes: frozenset[str] | None = getattr(sink, "consumes", None)
            if consumes is None:
                return None
            if isinstance(sink, CounterBlockSink) and sink.counter_state_apart:
                names.update(consumes & {name})
            else:
                names.update(consumes)
        return frozenset(names)

    def feed_block(self, block: CounterBlock) -> None:
        """`Analyzer.feed_all` of the block's lines, the counter lines of one (name, pid, allocator)."""
        count = len(block)
        analyzer = self.analyzer
        analyzer.events += count
        admission = analyzer.admission
        known = admission.levels.get(block.pid)
        if (known is None or known < COUNTED) and not admission.take(block.pid, level_of_block(block), count):
            return
        for feed in self._block_feeds(block.name) or ():
            feed(block)


def analyze_trace(
    path: str, *, progress: bool = False, host_memory_limit_bytes: int | None = None, growth_params: GrowthParams | None = None
) -> Analysis:
    """Streams a recorded trace (never loaded whole) through the detectors; the reader's notes
    (a cut tail, skipped lines) end up in the analysis. `progress` shows a bar on a TTY for
    large traces."""
    stats = ReadStats()
    analyzer = Analyzer(source=path, host_memory_limit_bytes=host_memory_limit_bytes, growth_params=growth_params)
    target = AnalyzerTarget(analyzer)
    size = os.path.getsize(path) if os.path.isfile(path) else 0
    if progress and size >= PROGRESS_BAR_MIN_BYTES and sys.stderr.isatty():
        from rich.progress import BarColumn, Progress, TransferSpeedColumn

        with Progress("replaying", BarColumn(), TransferSpeedColumn(), transient=True) as bar:
            task = bar.add_task("trace", total=size)
            replay_blocks(path, target, stats, lambda: bar.update(task, completed=stats.bytes_read))
    else:
        replay_blocks(path, target, stats)
    return analyzer.finish(notes=stats.notes(), damaged_lines=stats.corrupt_lines + stats.oversized_lines)
