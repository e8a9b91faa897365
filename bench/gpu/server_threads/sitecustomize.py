"""Where a benchmarked server's CPU goes, thread by thread, for the GPU server suite's cost arms.

Imported by `site` in every Python process of a server whose PYTHONPATH holds this folder (as the
sitecustomize after kvdoctor's own, which hands over to it) and whose environment sets
SUITE_THREADS_OUT (a folder): a daemon thread writes, every 2 s, each thread's CPU
seconds (/proc/self/task/*/stat, named by Python's thread names) and, where the probe's compiled
path is loaded, its counters (fast, diverted and slow calls per kind, launches). With SUITE_STACKS=1
it also samples the main thread's stack every millisecond and counts the innermost kvdoctor frame
(or "host"): a profile of the scheduler's thread, perturbed by the sampler itself, so it runs only
in arms of its own, never in the ones that are timed. Its thread imports nothing: an import there
while the probe's start-up hook imports the probe under the import system's lock hung the
server's start (the probe's own defect, mended in its start-up hook; this keeps the bench clear
of it on the releases it measures).
"""

import json
import os
import sys
import threading
import time

_OUT = os.environ.get("SUITE_THREADS_OUT", "")


def _cpu_by_thread() -> dict:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        out[f"{tid}:{names.get(int(tid), comm)}"] = round(cpu, 2)
    return out


def _native_stats():
    for name in ("kvdoctor.probe.native.path", "kvdoctor.probe.native"):
        mod = sys.modules.get(name)
        native = getattr(mod, "NATIVE", None) if mod else None
        if native is not None:
            try:
                return native.stats()
            except Exception as exc:  # a bench reading: never the server's problem
                return {"error": repr(exc)}
    return None


def _run() -> None:
    stacks = os.environ.get("SUITE_STACKS") == "1"
    main = threading.main_thread().ident
    counts: dict = {}
    path = os.path.join(_OUT, f"threads-{os.getpid()}.json")
    last_write = 0.0
    while True:
        if stacks:
            frame = sys._current_frames().get(main)
            key = "host"
            while frame is not None:
                fn = frame.f_code.co_filename
                if "/kvdoctor/" in fn:
                    key = f"{os.path.basename(fn)}:{frame.f_code.co_name}"
                    break
                frame = frame.f_back
            counts[key] = counts.get(key, 0) + 1
            time.sleep(0.001)
        else:
            time.sleep(2.0)
        now = time.monotonic()
        if now - last_write >= 2.0:
            last_write = now
            try:
                with open(path + ".tmp", "w") as fh:
                    json.dump(
                        {
                            "pid": os.getpid(),
                            "argv": sys.argv[:3],
                            "cpu_s": _cpu_by_thread(),
                            "native": _native_stats(),
                            "stack_samples": counts,
                        },
                        fh,
                    )
                os.replace(path + ".tmp", path)
            except Exception:
                pass


if _OUT:
    threading.Thread(target=_run, name="suite-threads", daemon=True).start()
