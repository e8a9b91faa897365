"""`kvdoctor watch PID`: a live server's memory over time, by process and class, and its growth.

The watch itself (sampling from /proc, one analyzer over everything it writes, the trace, the
optional Prometheus endpoint and attach) is kvdoctor.runner.watch; this command checks what it
was given, picks the view (the live table on a TTY, else JSON or text), and maps the result to an
exit code: 0 no error findings, 1 error findings, 2 nothing usable was sampled.
"""

from __future__ import annotations

import math
import sys

from kvdoctor.analysis.findings import ERROR
from kvdoctor.analysis.growth import GrowthParams
from kvdoctor.collect.procfs import check_process
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE, KvdoctorError
from kvdoctor.live.prometheus import parse_address
from kvdoctor.live.summary import write_watch_json, write_watch_text
from kvdoctor.outputs import reader_may_leave
from kvdoctor.reporters import check_format
from kvdoctor.runner.watch import run_watch

WATCH_FORMATS = ("auto", "text", "json")


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
) -> int:
    """Watches `pid` and its descendants until `duration_s`, Ctrl-C or the root's exit.

    `growth_params` tunes the growth test (warm-up, windows, minimum rate); the defaults suit
    watches of minutes to days. `prometheus` ("HOST:PORT") serves the live metrics there while
    the watch runs (see kvdoctor.live.prometheus). `force` lets `trace_path` replace a file.
    """
    check_format(output_format, WATCH_FORMATS)
    _check_seconds("interval", interval_s, finite=True)
    _check_seconds("duration", duration_s, finite=False)  # inf: until Ctrl-C or the server's exit
    if prometheus_public and prometheus is None:
        raise KvdoctorError("--prometheus-public has no address to open up", "give --prometheus HOST:PORT as well")
    check_process(pid)
    address = parse_address(prometheus, public=prometheus_public) if prometheus is not None else None
    live = output_format != "json" and sys.stdout.isatty()
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
    )
    with reader_may_leave():
        if output_format == "json" or (output_format == "auto" and not live):
            write_watch_json(result, sys.stdout)
        else:
            write_watch_text(result, sys.stdout)
        sys.stdout.flush()
    if result.samples == 0:
        print(f"kvdoctor: pid {pid} exited before it could be sampled; trace: {result.trace_path}", file=sys.stderr)
        return EXIT_UNUSABLE
    return EXIT_FINDINGS if any(f.severity == ERROR for f in result.findings) else EXIT_OK
