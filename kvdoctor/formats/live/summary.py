"""The summary of a finished `kvdoctor watch`: a line per process and the findings for a person,
or versioned JSON ("kvdoctor.watch/1") for a script."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TextIO

from kvdoctor.analysis.findings import Finding
from kvdoctor.analysis.gate_growth import not_judged_sentence
from kvdoctor.formats.live.view import display_title
from kvdoctor.outputs import one_line, strict
from kvdoctor.trace.schema import MEMORY_GROWTH
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
    # the growth verdict per process, as the gate says it (kvdoctor.analysis.gate_growth):
    # {"budget": "...", "held" / "not_judged" / "gone": {"pid N (title)": why}}; {} where none was made
    growth: dict[str, Any] = dataclasses.field(default_factory=dict)

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
    for finding in result.findings:
        print(f"{finding.severity.upper()} {finding.kind}: {one_line(finding.message)}", file=out)
    line = growth_line(result)
    if line:
        print(one_line(line), file=out)


def growth_line(result: WatchResult) -> str:
    """The watch's last line on growth, in the gate's words: not judged (and why) for a process
    whose data bounds no verdict, "no memory growth" only where the data bounds its rate under the
    floor, and nothing more where a growth finding (printed above) already names it."""
    growth = result.growth or {}
    grew = any(f.kind == MEMORY_GROWTH for f in result.findings)
    unjudged = {**(growth.get("not_judged") or {}), **(growth.get("gone") or {})}
    held = growth.get("held") or {}
    budget = growth.get("budget") or "the growth floor"
    if unjudged:
        return not_judged_sentence(unjudged)
    if grew:
        return ""
    if held:
        shown = "; ".join(f"{name}: {why}" for name, why in list(held.items())[:4])
        return f"no memory growth over {budget} ({shown})"
    return "memory growth not judged (no memory of any process was sampled)"


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
        "growth": result.growth,
    }


def write_watch_json(result: WatchResult, out: TextIO) -> None:
    print(json.dumps(strict(watch_report(result)), default=str, allow_nan=False), file=out)
