"""Every output kvdoctor writes, one row each: what it renders, the module that renders it, the
commands that offer it, its file suffix and content type.

The commands' `--format` choices (`choices`), their refusal of any other (`check_format`), their
`--help` (`format_help`) and the docs' table of outputs (docs/generate.py) all read these rows, so
a new output is its module plus one row here. The table names modules and imports none of them:
reading it costs a command nothing, and the renderers below it stay apart from each other.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from kvdoctor.errors import KvdoctorError

ANALYSIS = "a finished analysis"
VERDICT = "a gate's verdict"
LIVE = "a live watch or run"
PROFILE = "a profile"
COUNTERS = "a counter export"

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclasses.dataclass(frozen=True)
class OutputFormat:
    """One output. `offered_by` holds each command with the option that asks for it
    ("replay --format"); `help` is what that command's --help says of it (empty: its name says it)."""

    name: str
    renders: str
    module: str
    entry: str
    offered_by: tuple[str, ...]
    suffix: str
    content_type: str
    help: str = ""

    def load(self) -> Any:
        """The function (or class) that renders it, imported only now."""
        return getattr(importlib.import_module(self.module), self.entry)


_REPORTED = ("run --format", "replay --format", "demo --format")
_REPORTS = "kvdoctor.formats.reports"
_LIVE = "kvdoctor.formats.live"

FORMATS: tuple[OutputFormat, ...] = (
    OutputFormat("text", ANALYSIS, f"{_REPORTS}.terminal", "render_text", _REPORTED, ".txt", "text/plain; charset=utf-8"),
    OutputFormat("json", ANALYSIS, f"{_REPORTS}.json_report", "render_json", _REPORTED, ".json", "application/json"),
    OutputFormat(
        "jsonl",
        ANALYSIS,
        f"{_REPORTS}.jsonl",
        "render_jsonl",
        _REPORTED,
        ".jsonl",
        "application/x-ndjson",
        "a JSON line a finding, labelled as the Prometheus metrics are",
    ),
    OutputFormat(
        "html", ANALYSIS, f"{_REPORTS}.html", "render_html", (*_REPORTED, "gate --html"), ".html", "text/html", "one self-contained page"
    ),
    OutputFormat("junit", VERDICT, f"{_REPORTS}.junit", "render_junit", ("gate --junit",), ".xml", "application/xml"),
    OutputFormat(
        "github", VERDICT, f"{_REPORTS}.github", "github_annotations", ("gate (in GitHub Actions)",), "", "text/plain (workflow commands)"
    ),
    OutputFormat("auto", LIVE, f"{_LIVE}.view", "LiveView", ("watch --format",), "", "", "the live table on a terminal, else jsonl"),
    OutputFormat(
        "jsonl",
        LIVE,
        f"{_LIVE}.view",
        "WatchStream",
        ("watch --format",),
        ".jsonl",
        "application/x-ndjson",
        "a JSON line each interval and one for each finding as it arises, flushed, then the summary line",
    ),
    OutputFormat(
        "text",
        LIVE,
        f"{_LIVE}.summary",
        "write_watch_text",
        ("watch --format",),
        ".txt",
        "text/plain; charset=utf-8",
        "a line for each finding as it arises, then the summary",
    ),
    OutputFormat(
        "json",
        LIVE,
        f"{_LIVE}.summary",
        "write_watch_json",
        ("watch --format",),
        ".json",
        "application/json",
        "one JSON document when the watch ends",
    ),
    OutputFormat("metrics", LIVE, f"{_LIVE}.prometheus", "PrometheusExporter", ("watch --metrics",), "", PROMETHEUS_TEXT),
    OutputFormat(
        "metrics",
        LIVE,
        f"{_LIVE}.fleet_server",
        "FleetExporter",
        ("run --metrics", "attach --metrics"),
        "",
        "text/plain (prometheus_client's)",
    ),
    OutputFormat(
        "pprof",
        PROFILE,
        "kvdoctor.formats.pprof",
        "write_trace_profiles",
        ("run --attribution", "replay --pprof"),
        ".pb.gz",
        "application/gzip",
    ),
    OutputFormat("csv", COUNTERS, "kvdoctor.formats.counter_table", "write_table", ("export --format",), ".csv", "text/csv"),
    OutputFormat(
        "parquet",
        COUNTERS,
        "kvdoctor.formats.counter_table",
        "write_table",
        ("export --format",),
        ".parquet",
        "application/vnd.apache.parquet",
    ),
)


def offered(command: str, option: str = "--format") -> tuple[OutputFormat, ...]:
    """The rows `command`'s `option` chooses among, in the table's order."""
    return tuple(row for row in FORMATS if f"{command} {option}" in row.offered_by)


def choices(command: str) -> tuple[str, ...]:
    """The names `command --format` takes."""
    return tuple(row.name for row in offered(command))


def row(command: str, name: str) -> OutputFormat:
    """The row `command --format name` asks for (a name it does not take: `check_format`'s refusal)."""
    for candidate in offered(command):
        if candidate.name == name:
            return candidate
    raise _unknown(name, choices(command))


def check_format(name: str, command: str) -> str:
    """`name` when `command --format` takes it, else a one-line refusal (exit 2), before any work."""
    if name not in choices(command):
        raise _unknown(name, choices(command))
    return name


def _unknown(name: str, allowed: tuple[str, ...]) -> KvdoctorError:
    return KvdoctorError(f"unknown format {name!r}", "choose " + ", ".join(allowed))


def format_help(command: str) -> str:
    """What `command --format` says in --help: where every choice has a sentence, "name: sentence"
    for each; else the names, with a bracket for those whose name does not say it all."""
    rows = offered(command)
    if all(r.help for r in rows):
        return "; ".join(f"{r.name}: {r.help}" for r in rows)
    named = [f"{r.name} ({r.help})" if r.help else r.name for r in rows]
    return ", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else "".join(named)


def markdown_table() -> str:
    """The docs' table of outputs (docs/usage.md), from the rows."""
    lines = ["| output | renders | module | offered by | suffix | content type |", "|---|---|---|---|---|---|"]
    for r in FORMATS:
        offered_by = ", ".join(f"`{where}`" for where in r.offered_by)
        lines.append(f"| {r.name} | {r.renders} | `{r.module}.{r.entry}` | {offered_by} | {r.suffix or '-'} | {r.content_type or '-'} |")
    return "\n".join(lines)
