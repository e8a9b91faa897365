"""`kvdoctor export TRACE --format csv|parquet`: a trace's counters as one table (the layout is
described in kvdoctor.formats.counter_table)."""

from __future__ import annotations

import sys

from kvdoctor.errors import EXIT_OK
from kvdoctor.formats.counter_table import CHUNK_ROWS, write_table


def export(trace: str, output_format: str = "csv", output: str | None = None, *, chunk_rows: int = CHUNK_ROWS, force: bool = False) -> int:
    written = write_table(trace, output_format, output, chunk_rows=chunk_rows, force=force)
    if written.path == "-":
        if written.rows >= 0:
            print(f"kvdoctor: wrote {written.rows} row(s), {written.columns} column(s) as CSV", file=sys.stderr)
        return EXIT_OK
    note = "" if written.counter_events else " (the trace has no counter events)"
    print(f"kvdoctor: wrote {written.rows} row(s), {written.columns} column(s) to {written.path}{note}", file=sys.stderr)
    for line in written.stats.notes():
        if "no end marker" not in line:
            print(f"kvdoctor: note: {line}", file=sys.stderr)
    return EXIT_OK
