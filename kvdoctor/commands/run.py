"""`kvdoctor run -- CMD...`: start CMD with the probe in every Python process it starts, then
analyse the trace it left and exit with CMD's own exit code (the summary goes to stderr, so
CMD's output stays its own). The first line on stderr names the probe's native path (compiled, or
pure Python and why): the pure-Python path costs several times more per hooked call."""

from __future__ import annotations

import math
import os
import sys

from kvdoctor.analysis.gate import outlived_sentence
from kvdoctor.delivery.launch import run_command
from kvdoctor.errors import KvdoctorError
from kvdoctor.formats.live.fleet_server import FleetExporter
from kvdoctor.formats.pprof import profiles_folder
from kvdoctor.formats.reports import render
from kvdoctor.formats.table import check_format
from kvdoctor.outputs import printable
from kvdoctor.runner import analyze_recorded, check_attribution, check_fixes, default_trace_path, export_pprof
from kvdoctor.runner.support import native_path_line

MIN_SAMPLE_INTERVAL_S = 0.01  # a round over the tree reads /proc for every process: more often than this is a core


def run(
    command: list[str],
    trace_path: str | None,
    fixes: list[str],
    output_format: str = "text",
    sample_interval_s: float = 1.0,
    *,
    force: bool = False,
    attribution: tuple[bool, str | None] = (False, None),
    metrics: str | None = None,
    metrics_public: bool = False,
) -> int:
    check_format(output_format, "run")
    check_fixes(fixes)
    engine = check_attribution(attribution)
    if not (sample_interval_s >= 0 and math.isfinite(sample_interval_s)):
        raise KvdoctorError(f"--sample-interval must be 0 (off) or a positive number of seconds, not {sample_interval_s}")
    if 0 < sample_interval_s < MIN_SAMPLE_INTERVAL_S:
        raise KvdoctorError(
            f"--sample-interval {sample_interval_s:g} is below {MIN_SAMPLE_INTERVAL_S:g} s: sampling the process tree that often "
            "takes most of a CPU core from the run it measures",
            f"give {MIN_SAMPLE_INTERVAL_S:g} s or more, or 0 to turn sampling off; the default is 1 s",
        )
    trace_path = os.path.abspath(trace_path or default_trace_path("run"))
    exporter = FleetExporter(metrics, trace_path, public=metrics_public) if metrics is not None else None

    def on_start() -> None:
        say_native_path()
        if exporter is not None:
            exporter.start()
            print(f"kvdoctor: metrics on {exporter.url}", file=sys.stderr, flush=True)

    try:
        code, trace_path = run_command(command, trace_path, fixes, sample_interval_s, force=force, attribution=engine, on_start=on_start)
    finally:
        if exporter is not None:
            exporter.stop()
    try:
        analysis = analyze_recorded(trace_path)
    except KvdoctorError as exc:  # nothing of the trace is usable (a full disk): the command's status stands
        print(f"kvdoctor: warning: no analysis: {exc.message}", file=sys.stderr)
        return code
    print(printable(render(analysis, output_format)), file=sys.stderr)
    if engine:  # the attribution windows, beside the trace, for a profile store
        export_pprof(trace_path, analysis, profiles_folder(trace_path), force=force)
    if analysis.outlived:
        print(printable("kvdoctor: " + outlived_sentence(analysis.outlived)), file=sys.stderr)
    print(f"kvdoctor: trace {trace_path}", file=sys.stderr)
    return code


def say_native_path() -> None:
    print(f"kvdoctor: native path {native_path_line()}", file=sys.stderr, flush=True)
