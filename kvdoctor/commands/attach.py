"""`kvdoctor attach PID`: put the probe into a running Python server, no restart.

The probe then writes its own trace (by default `kvdoctor-attach-PID.kvtrace.json`), hooks the
SGLang classes already imported and those imported later, and with `--attribution` opens short
tracemalloc windows that name the file:line and thread where host memory grows. How the code
gets in, and when it cannot, is in kvdoctor/attach.py.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from kvdoctor.trace import schema
from kvdoctor.collect.attach import attach
from kvdoctor.errors import EXIT_OK, KvdoctorError


def default_trace_path(pid: int) -> str:
    return os.path.abspath(f"kvdoctor-attach-{pid}.kvtrace.json")


def attach_command(pid: int, trace_path: str | None, fixes: Sequence[str], attribution: bool = False) -> int:
    path = os.path.abspath(trace_path or default_trace_path(pid))
    status = attach(pid, path, list(fixes), attribution=attribution)
    written = status.get("trace_path") or path
    if status.get("already_active"):
        print(f"kvdoctor: the probe was already on in pid {pid}; it keeps writing {written}", file=sys.stderr)
    else:
        print(f"kvdoctor: probe attached to pid {pid} (Python {status.get('python', '?')}); trace: {written}", file=sys.stderr)
    return EXIT_OK


def attach_for_watch(pid: int, watch_trace_path: str, attribution: bool = True) -> str | None:
    """Attaches for `watch --attach`: the probe's trace path, or None after one line on stderr."""
    base = watch_trace_path[: -len(".kvtrace.json")] if watch_trace_path.endswith(".kvtrace.json") else watch_trace_path
    path = f"{base}.probe-{pid}.kvtrace.json"
    try:
        status = attach(pid, path, [], attribution=attribution)
    except KvdoctorError as exc:
        hint = f" ({exc.hint})" if exc.hint else ""
        print(f"kvdoctor: attach is not available for pid {pid}: {exc.message}{hint}; watching from outside", file=sys.stderr)
        return None
    written = status.get("trace_path") or path
    print(f"kvdoctor: probe attached to pid {pid}; its trace: {written}", file=sys.stderr)
    return written
