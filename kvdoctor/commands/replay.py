"""`kvdoctor replay TRACE`: run every detector over a recorded trace and render the findings."""

from __future__ import annotations

import os
import sys

from kvdoctor.analysis.analyzer import Analysis, analyze
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK
from kvdoctor.reporters import render
from kvdoctor.trace.reader import ReadStats, iter_events

PROGRESS_BAR_MIN_BYTES = 64 * 1024 * 1024


def analyze_trace(path: str, *, progress: bool = False) -> Analysis:
    """Streams the trace (never loads it whole) through the detectors."""
    stats = ReadStats()
    events = iter_events(path, stats)
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if progress and size >= PROGRESS_BAR_MIN_BYTES and sys.stderr.isatty():
        events = _with_progress(events, stats, size)
    analysis = analyze(events, source=path)
    analysis.notes.extend(stats.notes())
    return analysis


def _with_progress(events, stats: ReadStats, size: int):
    from rich.progress import BarColumn, Progress, TransferSpeedColumn

    with Progress("replaying", BarColumn(), TransferSpeedColumn(), transient=True) as bar:
        task = bar.add_task("trace", total=size)
        for i, event in enumerate(events):
            if i % 20000 == 0:
                bar.update(task, completed=stats.bytes_read)
            yield event


def exit_code_for(analysis: Analysis) -> int:
    return EXIT_FINDINGS if analysis.errors else EXIT_OK


def replay(path: str, output_format: str = "text", output: str | None = None) -> int:
    analysis = analyze_trace(path, progress=True)
    text = render(analysis, output_format)
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"kvdoctor: wrote {output_format} report to {output} ({len(analysis.findings)} findings)", file=sys.stderr)
    else:
        print(text)
    return exit_code_for(analysis)
