"""The services the commands call: watch a live process tree (watch), drive the demo (demo), and the
pieces they share: where a trace goes by default, and how a recorded trace is analysed on this
machine. Starting a command under the probe is kvdoctor.delivery.launch."""

from __future__ import annotations

import os
import sys
import time

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.analysis.growth import GrowthParams
from kvdoctor.analysis.replay import analyze_trace
from kvdoctor.collect.procfs import machine_memory_limit_bytes
from kvdoctor.errors import KvdoctorError


def default_trace_path(command: str, pid: int | None = None) -> str:
    """`./kvdoctor-<command>-<pid>-<YYYYmmdd-HHMMSS>.kvtrace.json`: which command wrote it, the
    process it is about (kvdoctor's own for run and demo), and when, so traces never collide."""
    pid = os.getpid() if pid is None else pid
    return os.path.abspath(f"kvdoctor-{command}-{pid}-{time.strftime('%Y%m%d-%H%M%S')}.kvtrace.json")


def analyze_recorded(path: str, *, progress: bool = False, growth_params: GrowthParams | None = None) -> Analysis:
    """`analyze_trace` with this machine's memory limit standing in where the trace records none
    (the time to OOM of a growth finding needs one)."""
    return analyze_trace(path, progress=progress, host_memory_limit_bytes=machine_memory_limit_bytes(), growth_params=growth_params)


def check_fixes(names: list[str]) -> list[str]:
    """`names` when every one is an optional fix kvdoctor has, else a one-line refusal: a fix
    that silently did nothing would leave the user believing the host was protected."""
    from kvdoctor.probe.base.fixes import FIXES, unknown

    bad = unknown(list(names))
    if bad:
        raise KvdoctorError(f"unknown fix {', '.join(bad)}", f"`kvdoctor fixes` lists them: {', '.join(FIXES)}")
    return list(names)


def check_attribution(asked: tuple[bool, str | None]) -> str:
    """The attribution engine from `--attribution` and `--attribution-engine` ("" when off)."""
    from kvdoctor.probe.readings.attribution_memray import ATTRIBUTION_BACKENDS

    on, engine = asked
    if engine is None:
        return "auto" if on else ""
    if engine.strip().lower() not in ATTRIBUTION_BACKENDS:
        raise KvdoctorError(f"unknown attribution engine {engine!r}", f"--attribution-engine takes {', '.join(ATTRIBUTION_BACKENDS)}")
    return engine.strip().lower()


def export_pprof(trace_path: str, analysis: Analysis, folder: str, *, force: bool = False) -> None:
    """The trace's attribution windows as pprof files in `folder`, said in one line on stderr; a
    folder that cannot be written is said too, and the verdict stands."""
    from kvdoctor.formats.pprof import write_trace_profiles

    try:
        written = write_trace_profiles(trace_path, analysis.processes, folder, force=force)
    except (OSError, KvdoctorError) as exc:
        print(f"kvdoctor: warning: no pprof profiles written to {folder}: {exc}", file=sys.stderr)
        return
    if written:
        print(f"kvdoctor: {len(written)} attribution window(s) as pprof in {folder} (go tool pprof -top FILE)", file=sys.stderr)
    else:
        print("kvdoctor: no attribution window in the trace: no pprof profile written (run with --attribution)", file=sys.stderr)
