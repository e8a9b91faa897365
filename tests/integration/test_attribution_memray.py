"""Host growth attribution with memray, on torch CPU tensors that tracemalloc cannot see.

A real child process holds SGLang 0.5.9's real `MHATokenToKVPoolHost` on the CPU. A thread named
`storage-backup` does what HiCache's L3 backup does with it (allocate host pages, take each page's
flat copy with the pool's own `get_data_page`, hand it to a storage backend) with a backend that
keeps every copy: the host-side growth of sglang#19332. Each copy is a 1 MiB torch CPU tensor,
`posix_memalign`ed by torch. The memray windows name SGLang's file:line and the thread; the
tracemalloc windows, on the same child, see only the Python tensor objects there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
from conftest import REPO, SGLANG_059, sglang_env, trace_events

from kvdoctor.analysis.detectors.host_growth_attribution import HostGrowthAttributionDetector
from kvdoctor.trace import schema

try:
    import memray
except ImportError:
    if os.environ.get("CI"):
        raise  # .ci/setup installs memray: missing in CI is a setup fault, not a reason to skip
    pytest.skip("memray is not installed (pip install memray; .ci/setup installs it)", allow_module_level=True)

PAGE_BYTES = 1 << 20  # 2 (k, v) x 8 layers x 64 tokens x 4 heads x 128 dims x 2 bytes
MAX_PAGES = 320  # the child stops growing there (memory bound of the test)

CHILD = textwrap.dedent(
    """
    import sys, threading, time, warnings
    warnings.filterwarnings("ignore")
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost
    from kvdoctor.probe.core import runtime

    device_pool = MHATokenToKVPool(size=1024, page_size=64, dtype=torch.bfloat16, head_num=4, head_dim=128, layer_num=8,
                                   device="cpu", enable_memory_saver=False)
    host = MHATokenToKVPoolHost(device_pool, host_to_device_ratio=2.0, host_size=0, page_size=64, layout="layer_first",
                                pin_memory=False, device="cpu")
    stored = {}  # a storage backend that keeps every page it was handed
    done = threading.Event()

    def backup():
        for n in range(MAX_PAGES):
            if done.is_set():
                return
            host_indices = host.alloc(64)
            stored[n] = host.get_data_page(int(host_indices[0]))   # BACKUP LINE
            host.free(host_indices)
            time.sleep(0.04)

    def idle():
        while True:
            time.sleep(0.01)

    probe = runtime.activate()
    backup_thread = threading.Thread(target=backup, name="storage-backup", daemon=True)
    backup_thread.start()
    threading.Thread(target=idle, name="idle-worker", daemon=True).start()
    print("ready", time.time(), flush=True)
    sys.stdin.read()  # until the test closes it: then a normal exit, with the windows still running
    done.set()
    backup_thread.join()  # (torch itself may abort an exit while a daemon thread is inside a torch op)
    """
).replace("MAX_PAGES", str(MAX_PAGES))


def _run_child(tmp_path, engine: str, enough: Callable[[list[dict], float], bool]) -> tuple[str, list[dict], int, float]:
    """Runs the child with attribution by `engine` until its trace holds `enough` windows (given
    the time the child was ready); returns the trace, its windows, its exit code and that time."""
    trace = str(tmp_path / f"{engine}.kvtrace.json")
    script = tmp_path / "backup_child.py"
    script.write_text(CHILD)
    env = sglang_env("0.5.9")
    env.update(
        KVDOCTOR_TRACE=trace,
        KVDOCTOR_ATTRIBUTION=engine,
        KVDOCTOR_ATTRIBUTION_PERIOD_S="1.5",
        KVDOCTOR_ATTRIBUTION_WINDOW_S="1.0",
        PYTHONPATH=os.pathsep.join([env.get("PYTHONPATH", ""), REPO]),
    )
    command = [sys.executable, str(script)]
    with open(tmp_path / f"{engine}.stderr", "w") as stderr:
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=str(tmp_path)
        )
        try:
            word, ready_unix_s = child.stdout.readline().split()  # type: ignore[union-attr]
            assert word == "ready"
            deadline = time.monotonic() + 40
            events: list[dict] = []
            while time.monotonic() < deadline and not enough(events, float(ready_unix_s)):
                time.sleep(0.3)
                events = trace_events(trace, schema.HOST_GROWTH_SITES)
            child.stdin.close()  # type: ignore[union-attr]
            code = child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert enough(events, float(ready_unix_s)), f"{len(events)} host_growth_sites events within 40 s"
    return trace, events, code, float(ready_unix_s)


def _after(events: list[dict], ready_unix_s: float) -> list[dict]:
    """The memray windows that opened once the child was ready (its thread grew all through them)."""
    return [e for e in events if e["args"].get("started_unix_s", 0) >= ready_unix_s]


def _backup_line() -> int:
    return CHILD.splitlines().index(next(ln for ln in CHILD.splitlines() if "BACKUP LINE" in ln)) + 1


def _flat_copy_line() -> tuple[str, int]:
    """Where SGLang 0.5.9's MHATokenToKVPoolHost.get_data_page makes the flat copy of a page."""
    path = os.path.join(SGLANG_059, "sglang", "srt", "mem_cache", "memory_pool_host.py")
    with open(path) as fh:
        lines = fh.read().splitlines()
    start = lines.index("class MHATokenToKVPoolHost(HostKVCache):")
    return path, next(k + 1 for k in range(start, len(lines)) if lines[k].strip() == "data_page = data_page.flatten()")


def test_memray_names_the_torch_growth_that_tracemalloc_cannot_see(tmp_path):
    copy_file, copy_line = _flat_copy_line()

    trace, events, code, ready_unix_s = _run_child(tmp_path, "memray", lambda ev, ready: bool(_after(ev, ready)))
    assert code == 0, "the child did not exit cleanly with memray windows running"
    status = [e["args"] for e in trace_events(trace, schema.PROBE_STATUS) if e["args"].get("component") == "attribution"]
    assert status and status[0]["state"] == "on" and status[0]["reason"].startswith("engine memray")
    args = _after(events, ready_unix_s)[0]["args"]
    assert args["engine"] == "memray"
    top = args["top_sites"][0]
    assert (top["file"], top["line"], top["function"]) == (copy_file, copy_line, "get_data_page")
    assert top["thread"] == "storage-backup" and top["threads"] == {"storage-backup": 1.0}
    assert top["size_diff_bytes"] >= 4 * PAGE_BYTES and top["count_diff"] >= 4  # the pages, and torch's small C++ objects
    assert f"backup_child.py:{_backup_line()} in backup" in top["stack"][1]
    assert args["by_thread"][0]["thread"] == "storage-backup"

    # The capture files are memray's own, rotated beside the trace, and small.
    assert args["captures"] and all(p.startswith(trace + ".memray.") for p in args["captures"])
    capture = args["captures"][0]
    assert os.path.getsize(capture) < 256 * 1024
    with memray.FileReader(capture) as reader:
        leaked = sum(r.size for r in reader.get_leaked_allocation_records(merge_threads=True))
    assert leaked >= top["size_diff_bytes"]

    detector = HostGrowthAttributionDetector()
    for raw in events:
        detector.feed(schema.Event.from_json_dict(raw))
    [finding] = detector.findings()
    assert f"thread storage-backup at {top['site']}" in finding.message and "memray" in finding.message
    assert "tracemalloc does not see" not in finding.message

    # The same child under the tracemalloc windows: the thread's line is there, its bytes are not.
    # (three windows: the second and third opened after the thread started growing)
    trace, tm_events, code, _ = _run_child(tmp_path, "tracemalloc", lambda ev, ready: len(ev) >= 3)
    assert code == 0
    for event in tm_events:
        tm_args = event["args"]
        assert tm_args["engine"] == "tracemalloc"
        at_copy = sum(s["size_diff_bytes"] for s in tm_args["top_sites"] if (s["file"], s["line"]) == (copy_file, copy_line))
        assert at_copy < PAGE_BYTES // 16 < top["size_diff_bytes"] // 64
        assert tm_args["growth_bytes"] < PAGE_BYTES


def test_tracemalloc_stands_in_where_memray_cannot_run(monkeypatch):
    from kvdoctor.probe.readings import attribution_memray

    emitted: list[tuple[str, dict]] = []

    class Emitter:
        def emit(self, name, args):
            emitted.append((name, args))

    class Probe:
        emitter = Emitter()
        trace_path = None

    monkeypatch.setitem(sys.modules, "memray", None)  # what find_spec reports for a missing package
    worker = attribution_memray.worker_for(Probe(), "auto")
    assert type(worker).__name__ == "TracemallocFallback"
    worker.stop.set()
    worker.start()
    worker.thread.join(timeout=10)
    [(name, status)] = emitted
    assert name == schema.PROBE_STATUS and status["component"] == "attribution" and status["state"] == "on"
    assert "engine tracemalloc" in status["reason"] and "memray is not installed" in status["reason"]
    assert type(attribution_memray.worker_for(Probe(), "tracemalloc")).__name__ == "Attribution"
    assert "names no engine" in attribution_memray.worker_for(Probe(), "memrey").reason  # type: ignore[attr-defined]


def test_memray_steps_aside_for_another_profiler():
    from kvdoctor.probe.readings import attribution_memray

    previous = sys.getprofile()
    sys.setprofile(lambda frame, event, arg: None)
    try:
        reason = attribution_memray.memray_unavailable_reason()
    finally:
        sys.setprofile(previous)
    assert reason is not None and "setprofile" in reason
    assert attribution_memray.memray_unavailable_reason() is None


def test_engine_names(monkeypatch):
    from kvdoctor.probe.readings import attribution_memray

    assert attribution_memray.engine_asked("1") == "tracemalloc"  # the meaning it always had
    assert attribution_memray.engine_asked("memray") == "memray" and attribution_memray.engine_asked(" Auto ") == "auto"
    assert attribution_memray.engine_asked("") is None and attribution_memray.engine_asked("", force=True) == "tracemalloc"


def test_an_unknown_engine_is_refused_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "run", "--attribution-engine", "memrey", "--trace", str(tmp_path / "t.json"), "--", "true"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown attribution engine 'memrey'" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_run_hands_the_engine_to_every_python_process(tmp_path):
    trace = str(tmp_path / "run.kvtrace.json")
    command = ["run", "--attribution-engine", "memray", "--sample-interval", "0", "--trace", trace, "--"]
    child = [sys.executable, "-c", "import os; print(os.environ['KVDOCTOR_ATTRIBUTION'])"]
    proc = subprocess.run([sys.executable, "-m", "kvdoctor", *command, *child], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "memray", proc.stderr[-2000:]
    status = [e["args"] for e in trace_events(trace, schema.PROBE_STATUS) if e["args"].get("component") == "attribution"]
    assert status and status[0]["reason"].startswith("engine memray")
