"""`kvdoctor attach PID`: put the probe into a running Python server, no restart.

The probe then writes its own trace, hooks the SGLang classes already imported and those
imported later, and with `--attribution` opens short windows (memray where installed, else
tracemalloc) that name the file:line and thread where host memory grows. How the code gets in, and when it cannot, is in
kvdoctor/collect/attach.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kvdoctor.collect.attach import attach
from kvdoctor.errors import EXIT_OK
from kvdoctor.runner import check_attribution, check_fixes, default_trace_path


def attach_command(
    pid: int, trace_path: str | None, fixes: Sequence[str], attribution: tuple[bool, str | None] = (False, None), *, force: bool = False
) -> int:
    fix_names = check_fixes(list(fixes))
    engine = check_attribution(attribution)
    path = os.path.abspath(trace_path or default_trace_path("attach", pid))
    status = attach(pid, path, fix_names, attribution=engine, force=force)
    written = status.get("trace_path") or path
    if status.get("already_active"):
        print(f"kvdoctor: the probe was already on in pid {pid}; it keeps writing {written}", file=sys.stderr)
    else:
        print(f"kvdoctor: probe attached to pid {pid} (Python {status.get('python', '?')}); trace: {written}", file=sys.stderr)
    return EXIT_OK
