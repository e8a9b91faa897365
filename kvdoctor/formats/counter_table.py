"""A trace's counters as one table, for pandas, spreadsheets and Parquet tools.

Every counter event (`ph` "C") named kv_slots, memory, memory_classes, hicache, l3_store or
probe_stats (`schema.COUNTER_NAMES`) becomes one row:
`ts_s` (seconds since the epoch), `pid`, `name`, `allocator` (empty where the event has none),
then one column per numeric argument seen anywhere in the trace (`free_slots`, `rss_bytes`, ...),
empty where an event lacks it. Columns whose values are all integers stay integers (nullable).

Memory stays bounded on traces of any size: a first streamed pass learns the columns and their
types, a second writes the rows in chunks of `CHUNK_ROWS` (CSV appended, Parquet row groups).
The file is written beside its destination and renamed into place only when complete, never
over the trace it reads. In CSV, text from the trace (an allocator's name, an argument's key) that
a spreadsheet would run as a formula starts with an apostrophe (kvdoctor.outputs.spreadsheet_cell).
pandas (and pyarrow for Parquet) come with `pip install 'kvdoctor[export]'`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

from kvdoctor.errors import KvdoctorError
from kvdoctor.formats.table import choices, format_help
from kvdoctor.formats.table import row as format_row
from kvdoctor.outputs import claim_output, names_stdout, reader_may_leave, spreadsheet_cell
from kvdoctor.trace import schema
from kvdoctor.trace.reader import ReadStats, iter_events

FORMATS = choices("export")
BASE_COLUMNS = ("ts_s", "pid", "name", "allocator")
CHUNK_ROWS = 50_000
_INT64_LIMIT = 1 << 63


def _require(output_format: str) -> Any:
    """pandas (and pyarrow for Parquet), or one line saying how to get them."""
    needed = "pandas and pyarrow" if output_format == "parquet" else "pandas"
    try:
        import pandas

        if output_format == "parquet":
            import pyarrow
            import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise KvdoctorError(
            f"export --format {output_format} needs {needed}, which {'are' if ' and ' in needed else 'is'} not installed",
            "pip install 'kvdoctor[export]'",
        ) from None
    return pandas


def default_output(trace: str, output_format: str) -> str:
    base = os.path.basename(trace)
    for suffix in (".json", ".kvtrace"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return os.path.join(os.path.dirname(os.path.abspath(trace)), f"{base or 'trace'}{format_row('export', output_format).suffix}")


def _column(key: str) -> str:
    return f"arg_{key}" if key in BASE_COLUMNS else key


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _counters(trace: str, stats: ReadStats | None = None) -> Iterator[schema.Event]:
    for event in iter_events(trace, stats):
        if event.ph == "C" and event.name in schema.COUNTER_NAMES:
            yield event


def scan_columns(trace: str) -> tuple[dict[str, bool], int, ReadStats]:
    """First pass: {column: holds only integers} in order of first appearance, and the rows."""
    columns: dict[str, bool] = {}
    rows = 0
    stats = ReadStats()
    for event in _counters(trace, stats):
        rows += 1
        for key, value in event.args.items():
            if key == "allocator" or not _is_number(value):
                continue
            name = _column(key)
            integral = isinstance(value, int) and -_INT64_LIMIT < value < _INT64_LIMIT
            columns[name] = columns.get(name, True) and integral
    return columns, rows, stats


def iter_frames(trace: str, columns: dict[str, bool], chunk_rows: int = CHUNK_ROWS) -> Iterator[Any]:
    """Second pass: DataFrames of at most `chunk_rows` rows, all with the same columns and dtypes."""
    import pandas

    numeric = list(columns)
    keys = [name[4:] if name.startswith("arg_") and name[4:] in BASE_COLUMNS else name for name in numeric]
    dtypes = {name: ("Int64" if integral else "float64") for name, integral in columns.items()}

    def frame(buffer: dict[str, list[Any]]) -> Any:
        data = {
            "ts_s": pandas.Series(buffer["ts_s"], dtype="float64"),
            "pid": pandas.Series(buffer["pid"], dtype="int64"),
            "name": pandas.Series(buffer["name"], dtype="object"),
            "allocator": pandas.Series(buffer["allocator"], dtype="object"),
        }
        for name in numeric:
            data[name] = pandas.Series(buffer[name], dtype=dtypes[name])
        return pandas.DataFrame(data, columns=[*BASE_COLUMNS, *numeric])

    def empty() -> dict[str, list[Any]]:
        return {name: [] for name in (*BASE_COLUMNS, *numeric)}

    buffer = empty()
    count = 0
    yielded = False
    for event in _counters(trace):
        args = event.args
        buffer["ts_s"].append(event.ts / 1e6)
        buffer["pid"].append(event.pid)
        buffer["name"].append(event.name)
        allocator = args.get("allocator")
        buffer["allocator"].append("" if allocator is None else str(allocator))
        for name, key in zip(numeric, keys, strict=False):
            value: Any = args.get(key)
            buffer[name].append(None if not _is_number(value) else value if columns[name] else float(value))
        count += 1
        if count >= chunk_rows:
            yield frame(buffer)
            yielded = True
            buffer = empty()
            count = 0
    if count or not yielded:  # an empty trace still gets a file with the header
        yield frame(buffer)


def _spreadsheet_safe(df: Any) -> Any:
    """The frame as CSV may carry it: names and text cells from the trace (an allocator's name, an
    argument's key) that a spreadsheet would run as a formula get a leading apostrophe."""
    df = df.rename(columns=spreadsheet_cell)
    for column in ("name", "allocator"):
        df[column] = df[column].map(spreadsheet_cell)
    return df


def _write(frames: Iterator[Any], output_format: str, destination: Any) -> int:
    rows = 0
    if output_format == "csv":
        first = True
        for df in frames:
            df = _spreadsheet_safe(df)
            df.to_csv(destination, index=False, header=first)
            first = False
            rows += len(df)
        return rows
    import pyarrow
    import pyarrow.parquet as pq

    writer = None
    try:
        for df in frames:
            table = pyarrow.Table.from_pandas(df, preserve_index=False)
            if writer is None:
                writer = pq.ParquetWriter(destination, table.schema)
            writer.write_table(table)
            rows += len(df)
    finally:
        if writer is not None:
            writer.close()
    return rows


@dataclasses.dataclass
class TableWritten:
    """What a write produced: where, how many rows and columns, and what the reader met."""

    path: str
    rows: int  # -1: written to a reader that went away before the end
    columns: int
    counter_events: int
    stats: ReadStats


def write_table(
    trace: str, output_format: str, output: str | None = None, *, chunk_rows: int = CHUNK_ROWS, force: bool = False
) -> TableWritten:
    """Writes the table to `output` (default: beside the trace), or as CSV to stdout for "-" or
    /dev/stdout; never over the trace it reads."""
    if output_format not in FORMATS:
        raise KvdoctorError(f"unknown export format {output_format!r}", "choose " + format_help("export"))
    on_stdout = output is not None and names_stdout(output)
    if on_stdout and output_format != "csv":
        raise KvdoctorError("Parquet cannot be written to stdout", "give -o a file path")
    _require(output_format)
    path = "-" if on_stdout else claim_output(output or default_output(trace, output_format), force=force, what="table", inputs=[trace])
    columns, rows, stats = scan_columns(trace)
    width = len(BASE_COLUMNS) + len(columns)
    if on_stdout:
        written = -1  # stays so when the reader goes away (`export -o - | head`): the rest is not written
        with reader_may_leave():
            written = _write(iter_frames(trace, columns, chunk_rows), "csv", sys.stdout)
            sys.stdout.flush()
        return TableWritten("-", written, width, rows, stats)
    partial = f"{path}.partial-{os.getpid()}"
    try:
        if output_format == "csv":
            with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8", newline="") as fh:
                written = _write(iter_frames(trace, columns, chunk_rows), "csv", fh)
        else:
            written = _write(iter_frames(trace, columns, chunk_rows), "parquet", partial)
            os.chmod(partial, 0o600)
        os.replace(partial, path)
    except OSError as exc:
        raise KvdoctorError(f"cannot write {path}: {exc.strerror or exc}", "give -o a writable path") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return TableWritten(path, written, width, rows, stats)
