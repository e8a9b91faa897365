"""The summary of a finished `kvdoctor watch`: a line per process and the findings for a person,
or versioned JSON ("kvdoctor.watch/1") for a script."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TextIO

from kvdoctor.analysis.findings import Finding
from kvdoctor.live.view import display_title
from kvdoctor.outputs import one_line, strict
from kvdoctor.units import format_duration, format_optional_bytes

WATCH_SCHEMA_ID = "kvdoctor.watch/1"


@dataclasses.dataclass
class WatchResult:
    """What a finished watch saw (kvdoctor.runner.watch makes it), rendered below."""

    root_pid: int
    trace_path: str
    findings: list[Finding]
    processes: list[dict[str, Any]]
    rounds: int
    elapsed_s: float
    root_exited: bool

    @property
    def samples(self) -> int:
        return sum(int(p["samples"]) for p in self.processes)


def write_watch_text(result: WatchResult, out: TextIO) -> None:
    """The summary a person reads after a watch: one line per process, then the findings."""
    print(
        f"kvdoctor watch {result.root_pid}: {len(result.processes)} process(es), {result.rounds} samples over "
        f"{format_duration(result.elapsed_s)}; trace: {result.trace_path}",
        file=out,
    )
    for proc in result.processes:
        state = "exited" if proc["exited"] else "running"
        print(
            f"  {proc['pid']:>7}  {proc['role']:<11} rss {format_optional_bytes(proc['rss_bytes']):>9} "
            f"(peak {format_optional_bytes(proc['peak_rss_bytes'])})  {state:<7} {display_title(proc['title'])[:60]}",
            file=out,
        )
    if not result.findings:
        print("no memory growth found", file=out)
        return
    for finding in result.findings:
        print(f"{finding.severity.upper()} {finding.kind}: {one_line(finding.message)}", file=out)


def watch_report(result: WatchResult) -> dict[str, Any]:
    """The JSON a script reads after a watch (versioned: `schema` is "kvdoctor.watch/1")."""
    return {
        "schema": WATCH_SCHEMA_ID,
        "findings": [f.to_dict() for f in result.findings],
        "trace": result.trace_path,
        "samples": result.rounds,
        "duration_s": result.elapsed_s,
        "root_exited": result.root_exited,
        "processes": result.processes,
    }


def write_watch_json(result: WatchResult, out: TextIO) -> None:
    print(json.dumps(strict(watch_report(result)), default=str, allow_nan=False), file=out)
