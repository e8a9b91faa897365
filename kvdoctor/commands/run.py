"""`kvdoctor run -- CMD...`: start CMD with the probe in every Python process it starts.

The probe rides in through PYTHONPATH (a sitecustomize that activates it and then chains to the
host's own), so multiprocessing spawn children such as SGLang's scheduler carry it too. Every
process appends to one trace; when CMD ends we close the trace, analyse it, and exit with CMD's
exit code.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

from kvdoctor.trace import schema
from kvdoctor.errors import KvdoctorError
from kvdoctor.trace.writer import TraceWriter, finish_trace

INJECT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_inject")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_trace_path(prefix: str = "kvdoctor") -> str:
    return os.path.abspath(f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.kvtrace.json")


def probe_environment(trace_path: str, fixes: list[str], base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = INJECT_DIR + (os.pathsep + existing if existing else "")
    env["KVDOCTOR_TRACE"] = trace_path
    env["KVDOCTOR_PACKAGE_ROOT"] = PACKAGE_ROOT
    if fixes:
        env["KVDOCTOR_FIXES"] = ",".join(fixes)
    return env


def start_trace(trace_path: str, command: list[str], extra: dict | None = None) -> None:
    if os.path.exists(trace_path):
        os.remove(trace_path)
    writer = TraceWriter(trace_path)
    header = schema.header_event(
        pid=os.getpid(), engine="", engine_version="", process_title="kvdoctor " + " ".join(command)[:160],
        extra={"command": command, **(extra or {})},
    )
    header.name = schema.RUN_HEADER
    writer.write_batch([header])
    writer.close()


def _start_sampler(pid: int, trace_path: str, interval_s: float):
    """Samples CMD's process tree from outside (memory by class) into the same trace, so growth is
    judged for every process, probed or not."""
    import threading

    from kvdoctor.collect.sampler import Sampler

    stop = threading.Event()
    writer = TraceWriter(trace_path)
    sampler = Sampler(pid, interval_s=interval_s, emit=writer)

    def loop() -> None:
        try:
            sampler.run(stop=stop)
        except Exception:
            pass  # the sampler never takes the run down with it
        finally:
            writer.close()

    thread = threading.Thread(target=loop, name="kvdoctor-sampler", daemon=True)
    thread.start()
    return stop, thread


def run_command(command: list[str], trace_path: str | None, fixes: list[str], sample_interval_s: float = 1.0) -> tuple[int, str]:
    if not command:
        raise KvdoctorError("no command given", "usage: kvdoctor run [--trace PATH] -- CMD ...")
    executable = shutil.which(command[0])
    if executable is None:
        raise KvdoctorError(f"command not found: {command[0]}", "check the spelling or give a full path")
    trace_path = os.path.abspath(trace_path or default_trace_path())
    try:
        start_trace(trace_path, command, {"fixes": fixes})
    except OSError as exc:
        raise KvdoctorError(f"cannot write the trace {trace_path}: {exc.strerror}", "pass --trace to a writable place") from None
    env = probe_environment(trace_path, fixes)
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise KvdoctorError(f"cannot start {command[0]}: {exc.strerror}") from None
    sampling = _start_sampler(child.pid, trace_path, sample_interval_s) if sample_interval_s > 0 else None
    forwarded = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        forwarded[sig] = signal.signal(sig, lambda s, _f: child.send_signal(s))
    try:
        code = child.wait()
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
        if sampling is not None:
            sampling[0].set()
            sampling[1].join(timeout=5)
    finish_trace(trace_path, os.getpid())
    return (code if code >= 0 else 128 - code), trace_path
