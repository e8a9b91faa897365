"""`kvdoctor watch PID`: a live server's memory over time, by process and class, and its growth.

The watch itself (sampling from /proc, one analyzer over everything it writes, the trace, the
optional Prometheus endpoint and attach) is kvdoctor.runner.watch; this command checks what it
was given, picks the view, and maps the result to an exit code: 0 no error findings, 1 error
findings, 2 nothing usable was sampled.

The views: on a TTY (auto, text) the live table, then the text summary. Without one, a stream,
each line flushed so that `| tee` or a log collector sees it as it comes: auto and jsonl write a
JSON line each round and one for each finding as it is first seen, then the summary as the last
line (kvdoctor.formats.live.view.WatchStream); text writes a line for each finding as it arises, then the
text summary. json writes nothing until the end, then one JSON document (the summary), as it
always has, for a script that reads the whole output at once.
"""

from __future__ import annotations

import math
import sys

from kvdoctor.analysis.findings import ERROR
from kvdoctor.analysis.growth import GrowthParams
from kvdoctor.collect.procfs import check_process
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE, KvdoctorError
from kvdoctor.formats.live.prometheus import parse_address
from kvdoctor.formats.live.summary import watch_report, write_watch_json, write_watch_text
from kvdoctor.formats.live.view import LIVE_GROWTH_EVERY_S, WatchStream
from kvdoctor.formats.table import check_format
from kvdoctor.outputs import reader_may_leave
from kvdoctor.runner.watch import run_watch


def _check_seconds(name: str, value: float | None, *, finite: bool) -> None:
    if value is not None and not (value > 0 and (math.isfinite(value) or not finite)):
        raise KvdoctorError(f"--{name} must be a positive number of seconds, not {value}")


def watch(
    pid: int,
    interval_s: float = 1.0,
    duration_s: float | None = None,
    trace_path: str | None = None,
    output_format: str = "auto",
    attach: bool = False,
    *,
    growth_params: GrowthParams | None = None,
    prometheus: str | None = None,
    prometheus_public: bool = False,
    force: bool = False,
    option: str = "--prometheus",
) -> int:
    """Watches `pid` and its descendants until `duration_s`, Ctrl-C or the root's exit.

    `growth_params` tunes the growth test (warm-up, windows, minimum rate); the defaults suit
    watches of minutes to days. `prometheus` ("HOST:PORT") serves the live metrics there while
    the watch runs (see kvdoctor.formats.live.prometheus); `option` is its name as the user gave it
    (--metrics, or its older name --prometheus), for a refusal to say. `force` lets `trace_path`
    replace a file.
    """
    check_format(output_format, "watch")
    _check_seconds("interval", interval_s, finite=True)
    _check_seconds("duration", duration_s, finite=False)  # inf: until Ctrl-C or the server's exit
    if prometheus_public and prometheus is None:
        raise KvdoctorError(f"{option}-public has no address to open up", f"give {option} HOST:PORT as well")
    check_process(pid)
    address = parse_address(prometheus, public=prometheus_public, option=option) if prometheus is not None else None
    live = output_format in ("auto", "text") and sys.stdout.isatty()
    streaming = not live and output_format != "json"
    as_json = output_format in ("auto", "jsonl")
    stream = WatchStream(sys.stdout, as_json=as_json, findings_every_s=max(LIVE_GROWTH_EVERY_S, interval_s)) if streaming else None
    result = run_watch(
        pid,
        interval_s=interval_s,
        duration_s=duration_s,
        trace_path=trace_path,
        live=live,
        attach=attach,
        growth_params=growth_params,
        prometheus_address=address,
        force=force,
        stream=stream,
    )
    with reader_may_leave():
        if stream is not None and as_json:
            stream.summary(watch_report(result), result.findings)
        elif output_format == "json":
            write_watch_json(result, sys.stdout)
        else:
            write_watch_text(result, sys.stdout)
        sys.stdout.flush()
    if result.samples == 0:
        print(f"kvdoctor: pid {pid} exited before it could be sampled; trace: {result.trace_path}", file=sys.stderr)
        return EXIT_UNUSABLE
    return EXIT_FINDINGS if any(f.severity == ERROR for f in result.findings) else EXIT_OK


def watch_metrics(
    metrics: str | None, metrics_public: bool, prometheus: str | None, prometheus_public: bool
) -> tuple[str | None, bool, str]:
    """The metrics address of a watch, given by its name or its older one (--prometheus), and the
    name to say in a refusal: the one the user wrote."""
    if metrics is not None and prometheus is not None:
        raise KvdoctorError(
            "--metrics and --prometheus name the same address", "give one of them: --prometheus is the older name of --metrics"
        )
    if prometheus is not None or (prometheus_public and not metrics_public and metrics is None):
        return prometheus, prometheus_public or metrics_public, "--prometheus"
    return metrics, metrics_public or prometheus_public, "--metrics"
