"""`kvdoctor attach PID`: put the probe into a running Python server, no restart.

The probe then writes its own trace, hooks the SGLang classes already imported and those
imported later, and with `--attribution` opens short windows (memray where installed, else
tracemalloc) that name the file:line and thread where host memory grows. How the code gets in, and when it cannot, is in
kvdoctor/delivery/attach.py.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from kvdoctor.delivery.attach import attach
from kvdoctor.errors import EXIT_OK
from kvdoctor.formats.live.fleet_server import FleetExporter
from kvdoctor.runner import check_attribution, check_fixes, default_trace_path


def attach_command(
    pid: int,
    trace_path: str | None,
    fixes: Sequence[str],
    attribution: tuple[bool, str | None] = (False, None),
    *,
    force: bool = False,
    metrics: str | None = None,
    metrics_public: bool = False,
    gdb: str | None = None,
) -> int:
    fix_names = check_fixes(list(fixes))
    engine = check_attribution(attribution)
    path = os.path.abspath(trace_path or default_trace_path("attach", pid))
    exporter = FleetExporter(metrics, path, public=metrics_public) if metrics is not None else None  # a bad address stops us here
    status = attach(pid, path, fix_names, attribution=engine, force=force, gdb_path=gdb)
    written = status.get("trace_path") or path
    if status.get("already_active"):
        print(f"kvdoctor: the probe was already on in pid {pid}; it keeps writing {written}", file=sys.stderr)
    else:
        print(f"kvdoctor: probe attached to pid {pid} (Python {status.get('python', '?')}); trace: {written}", file=sys.stderr)
    if exporter is not None:
        serve_until_gone(exporter if written == path else FleetExporter(metrics or "", written, public=metrics_public), pid)
    return EXIT_OK


def serve_until_gone(exporter: FleetExporter, pid: int) -> None:
    """Serves the attached probe's ledgers until the process exits (or Ctrl-C): the probe writes its
    trace from its own thread, this process follows it, the target does no more work for it."""
    exporter.start()
    print(f"kvdoctor: metrics on {exporter.url} until pid {pid} exits (Ctrl-C stops them)", file=sys.stderr, flush=True)
    try:
        while _alive(pid):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        exporter.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
