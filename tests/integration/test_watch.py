"""`kvdoctor watch`: sampling real child processes from /proc, and the growth test behind it.

The process tests start small Python programs that print "ready" once set up and then grow,
plateau, exit, or hold a /dev/zero shared mapping (how cudaHostAlloc pinned memory looks from
outside). The growth tests drive kvdoctor.analysis.growth with synthetic series on a fake clock.
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import math
import os
import queue
import random
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdoctor.analysis import growth
from kvdoctor.analysis.detectors.memory_growth import MemoryGrowthDetector
from kvdoctor.collect.procfs import check_process, find_process_tree, guess_role, machine_memory_limit_bytes, sample_process
from kvdoctor.collect.sampler import Sampler
from kvdoctor.commands.watch import watch
from kvdoctor.errors import KvdoctorError
from kvdoctor.formats.live.view import LiveView, sparkline
from kvdoctor.trace import schema
from kvdoctor.trace.reader import ReadStats, iter_events

MIB = 1024 * 1024
GB = 1e9

# Short watches need a short warm-up and minimum span; the defaults are for real servers.
FAST = growth.GrowthParams(warmup_s=2.0, min_span_s=6.0, min_samples=12)

# --------------------------------------------------------------------------- child processes

GROWER = textwrap.dedent(
    """
    import sys, threading, time
    rate_mib_s, cap_mib = float(sys.argv[1]), int(sys.argv[2])
    held = []
    def grow():
        start = time.monotonic()
        for k in range(cap_mib):
            # paced on absolute deadlines so the average rate is exact under scheduling jitter
            delay = start + k / rate_mib_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            held.append(b"x" * (1 << 20))   # filled, so every page is touched
    threading.Thread(target=grow, daemon=True).start()
    print("ready", flush=True)
    time.sleep(120)
    """
)

PLATEAU = textwrap.dedent(
    """
    import time
    print("ready", flush=True)
    held = []
    for k in range(200):            # 200 MiB in about 4 s, then nothing more
        held.append(b"x" * (1 << 20))
        time.sleep(0.02)
    time.sleep(120)
    """
)

EXITER = textwrap.dedent(
    """
    import time
    print("ready", flush=True)
    time.sleep(1.5)
    """
)

TREE = textwrap.dedent(
    """
    import subprocess, sys, time
    print("ready", flush=True)
    time.sleep(0.3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)", "sglang::scheduler_TP0"])
    child.wait()
    time.sleep(0.8)
    """
)

PINNED = textwrap.dedent(
    """
    import mmap, time
    size = 64 << 20
    zero = open("/dev/zero", "r+b")
    shared = mmap.mmap(zero.fileno(), size, mmap.MAP_SHARED)        # like cudaHostAlloc's pages
    private = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # plain heap: not pinned
    for off in range(0, size, 4096):
        shared[off] = 1
        private[off] = 1
    print("ready", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(code: str, *args: str, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen([kwargs.pop("python", sys.executable), "-c", code, *args], stdout=subprocess.PIPE, text=True, **kwargs)
        procs.append(proc)
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"child did not start: {line!r}"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _events(path: str) -> list[schema.Event]:
    return list(iter_events(path))


# --------------------------------------------------------------------------- watch on real processes


class FlushedLines(io.TextIOBase):
    """A stdout that is no terminal and keeps each line with the time it was flushed: what the
    reader of a pipe gets, and when."""

    def __init__(self) -> None:
        self.pending = ""
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.pending += text
        return len(text)

    def flush(self) -> None:
        *done, self.pending = self.pending.split("\n")
        self.lines += [(time.monotonic(), line) for line in done]

    def isatty(self) -> bool:
        return False


def test_growing_child_is_flagged_as_anon_growth_at_the_right_rate(spawn, tmp_path, monkeypatch):
    """Without a terminal (jsonl, as auto is then): the growth is a line as soon as it is found,
    while the watch goes on, and the summary, the last line, agrees with what was streamed."""
    rate_mib_s = 8.0
    child = spawn(GROWER, str(rate_mib_s), "300")
    trace = str(tmp_path / "grow.kvtrace.json")
    out = FlushedLines()
    monkeypatch.setattr(sys, "stdout", out)
    code = watch(child.pid, interval_s=0.25, duration_s=14, trace_path=trace, output_format="jsonl", growth_params=FAST)
    assert out.pending == ""  # every line was flushed
    lines = [(at, json.loads(text)) for at, text in out.lines]
    assert all(line["schema"] == "kvdoctor.watch/1" for _, line in lines)
    *streamed, (_, report) = lines
    assert report["type"] == "summary" and report["no_longer_found"] == []
    samples = [(at, line) for at, line in streamed if line["type"] == "sample"]
    found = [(at, line) for at, line in streamed if line["type"] == "finding"]
    assert [line["samples"] for _, line in samples] == list(range(1, report["samples"] + 1))  # one line a round
    grew = [(at, line) for at, line in found if line["kind"] == "memory_growth" and line["pid"] == child.pid]
    assert len(grew) == 1 and grew[0][0] < samples[-1][0] - 1.0, found  # said while the watch still ran, not at its end
    assert sorted((f["kind"], f["pid"]) for _, f in found) == sorted((f["kind"], f["pid"]) for f in report["findings"])
    assert samples[-1][1]["processes"] == report["processes"]  # the last round's numbers are the summary's
    assert code == 1
    growth_findings = [f for f in report["findings"] if f["kind"] == "memory_growth" and f["pid"] == child.pid]
    classes = sorted(f["evidence"]["memory_class"] for f in growth_findings)
    assert classes == ["anon"], report["findings"]  # rss is not reported twice for the same growth
    evidence = growth_findings[0]["evidence"]
    measured_mib_s = evidence["bytes_per_s"] / MIB
    assert abs(measured_mib_s - rate_mib_s) <= 0.3 * rate_mib_s, measured_mib_s
    assert 0 < evidence["lower_bound_bytes_per_s"] <= evidence["bytes_per_s"]
    assert evidence["time_to_oom_s"] is not None and evidence["time_to_oom_s"] > 0
    assert evidence["samples"] >= 12
    assert "anonymous memory grows" in growth_findings[0]["message"]
    assert report["trace"] == trace and report["samples"] >= 40
    # the trace holds the run header first, the counters, and the findings; and it is closed
    stats = ReadStats()
    events = list(iter_events(trace, stats))
    assert events[0].name == schema.RUN_HEADER and events[0].args["command"] == "watch"
    assert events[0].args["root_pid"] == child.pid
    assert sum(1 for e in events if e.name == schema.MEMORY_COUNTER) >= 40
    assert any(e.name == schema.FINDING and e.args["kind"] == "memory_growth" for e in events)
    assert stats.clean_end


def test_child_that_warms_up_to_a_plateau_is_not_flagged(spawn, tmp_path, capsys):
    child = spawn(PLATEAU)
    trace = str(tmp_path / "plateau.kvtrace.json")
    code = watch(child.pid, interval_s=0.25, duration_s=14, trace_path=trace, output_format="json", growth_params=FAST)
    report = json.loads(capsys.readouterr().out)
    assert report["findings"] == [] and code == 0
    proc = next(p for p in report["processes"] if p["pid"] == child.pid)
    assert proc["anon_bytes"] >= 190 * MIB  # it did take the memory, and then held it


def test_a_short_watch_of_a_growing_process_says_its_growth_was_not_judged_and_why(spawn, tmp_path, capsys):
    """3 s of a process climbing 40 MiB/s is too little to call growth (or to bound it): watch's
    last line says "not judged" with the gate's reason, never "no memory growth found"; its JSON
    summary and the HTML of its trace say the same."""
    child = spawn(GROWER, "40", "400")
    trace = str(tmp_path / "short.kvtrace.json")
    assert watch(child.pid, interval_s=0.25, duration_s=3, trace_path=trace, output_format="text") == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "no memory growth found" not in last
    assert last.startswith(f"memory growth not judged (pid {child.pid} ") and "needed to call growth" in last, last
    why = last.split(": ", 1)[1].rstrip(")")

    child2 = spawn(GROWER, "40", "400")
    trace2 = str(tmp_path / "short2.kvtrace.json")
    watch(child2.pid, interval_s=0.25, duration_s=3, trace_path=trace2, output_format="jsonl")
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["type"] == "summary" and not summary["findings"], summary
    ((name, reason),) = summary["growth"]["not_judged"].items()
    assert name.startswith(f"pid {child2.pid}") and "needed to call growth" in reason, summary["growth"]

    from kvdoctor.analysis.replay import analyze_trace
    from kvdoctor.formats.reports import render

    page = render(analyze_trace(trace), "html")
    assert "No error findings.</div>" not in page and "memory growth was not judged" in page
    assert html.escape(why.split(" (", 1)[0], quote=True) in page, why
    assert render(analyze_trace(trace), "text").splitlines()[-2] == last  # a replay's text says it alike


def test_watch_through_a_pipe_writes_a_line_each_interval_while_the_process_runs(spawn, tmp_path):
    """`kvdoctor watch PID | tee`: the first JSON line comes within two intervals of the watch's
    start, while the watched process (and the watch, 300 s long) still run; the lines go on each
    interval, and once the process is gone the last line is the summary, agreeing with them."""
    interval_s = 1.0
    child = spawn(GROWER, "4", "200")
    env = {key: value for key, value in os.environ.items() if key != "KVDOCTOR_TRACE"}
    command = [sys.executable, "-m", "kvdoctor.cli", "watch", str(child.pid), "--interval", str(interval_s), "--duration", "300"]
    watcher = subprocess.Popen(
        [*command, "--trace", str(tmp_path / "w.kvtrace.json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    arrived: queue.Queue[tuple[float, str | None]] = queue.Queue()

    def read() -> None:
        for text in watcher.stdout:
            arrived.put((time.time(), text))
        arrived.put((time.time(), None))

    threading.Thread(target=read, daemon=True).start()
    try:
        at_s, text = arrived.get(timeout=120)  # generous: starting Python on a loaded machine takes seconds
        assert child.poll() is None and watcher.poll() is None, watcher.stderr.read() if watcher.poll() is not None else ""
        first = json.loads(text)
        assert first["type"] == "sample" and first["samples"] == 1 and first["elapsed_s"] <= 2 * interval_s, first
        assert at_s - first["time_s"] < 10, "the line was held back before it reached the pipe"
        assert [p["pid"] for p in first["processes"]] == [child.pid] and first["processes"][0]["rss_bytes"] > 0
        at_s, text = arrived.get(timeout=120)
        second = json.loads(text)
        assert second["samples"] == 2 and child.poll() is None
    finally:
        child.kill()
        child.wait()
    assert watcher.wait(timeout=120) in (0, 1), watcher.stderr.read()
    rest = []
    while (item := arrived.get(timeout=120))[1] is not None:
        rest.append(json.loads(item[1]))
    *samples, summary = [first, second, *rest]
    assert summary["type"] == "summary" and summary["root_exited"], summary
    assert [line["samples"] for line in samples] == list(range(1, summary["samples"] + 1))  # a line each round, none held back

    def numbers(processes):
        return [(p["pid"], p["rss_bytes"], p["peak_rss_bytes"], p["samples"]) for p in processes]

    assert numbers(samples[-1]["processes"]) == numbers(summary["processes"])  # the last round's numbers are the summary's


def test_a_watch_stream_says_each_finding_once_and_what_the_summary_no_longer_finds():
    from kvdoctor.analysis.findings import Finding
    from kvdoctor.formats.live.view import WatchStream

    growth_anon = Finding(
        "memory_growth", "error", "scheduler (pid 7) anonymous memory grows\n2 GiB/h", evidence={"memory_class": "anon"}, pid=7
    )
    growth_gpu = Finding("memory_growth", "error", "pid 7 GPU memory grows", evidence={"memory_class": "gpu"}, pid=7)
    later = Finding("double_free", "error", "2 double frees", count=2, pid=8)
    text = io.StringIO()
    stream = WatchStream(text, as_json=False, findings_every_s=0.0)
    stream.round(1, [], lambda: [growth_anon])
    stream.round(2, [], lambda: [dataclasses.replace(growth_anon, message="grows faster"), growth_gpu])  # the same, and a new one
    assert text.getvalue().splitlines() == [
        "kvdoctor watch: ERROR memory_growth: scheduler (pid 7) anonymous memory grows\\x0a2 GiB/h",  # one line, whatever the message
        "kvdoctor watch: ERROR memory_growth: pid 7 GPU memory grows",
    ]
    lines = io.StringIO()
    stream = WatchStream(lines, as_json=True, findings_every_s=3600.0)
    stream.round(1, [{"pid": 7}], lambda: [growth_anon, growth_gpu])
    stream.round(2, [{"pid": 7}], lambda: [growth_anon, growth_gpu, later])  # not looked for again within the hour
    stream.summary({"schema": "kvdoctor.watch/1", "findings": [growth_anon.to_dict(), later.to_dict()]}, [growth_anon, later])
    got = [json.loads(line) for line in lines.getvalue().splitlines()]
    assert [(line["type"], line.get("kind"), line.get("samples")) for line in got] == [
        ("sample", None, 1),
        ("finding", "memory_growth", None),
        ("finding", "memory_growth", None),
        ("sample", None, 2),
        ("finding", "double_free", None),  # found only at the end: said before the summary
        ("summary", None, None),
    ]
    assert [f["evidence"]["memory_class"] for f in got[-1]["no_longer_found"]] == ["gpu"]


def test_a_watch_stream_whose_reader_left_keeps_the_watch_going(spawn, tmp_path):
    sleeper = spawn("import time; print('ready', flush=True); time.sleep(60)")
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write fails with EPIPE, as after `| head -1`
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvdoctor.cli", "watch", str(sleeper.pid), "--interval", "0.2", "--duration", "1.5"]
            + ["--trace", str(tmp_path / "w.kvtrace.json")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert _events(str(tmp_path / "w.kvtrace.json"))[-1].name == schema.TRACE_END


def test_child_exiting_mid_watch_leaves_a_readable_trace(spawn, tmp_path, capsys):
    child = spawn(EXITER)
    trace = str(tmp_path / "exit.kvtrace.json")
    started = time.monotonic()
    code = watch(child.pid, interval_s=0.1, duration_s=30, trace_path=trace, output_format="text")
    elapsed = time.monotonic() - started
    captured = capsys.readouterr()
    assert code == 0
    assert elapsed < 10, "watch should stop when the watched process exits"
    assert f"pid {child.pid} exited; analysing what was sampled" in captured.err
    assert "no memory growth found" not in captured.out  # 1.5 s of a process judges no growth
    assert captured.out.splitlines()[-1].startswith("memory growth not judged (pid "), captured.out
    events = _events(trace)
    assert events[0].name == schema.RUN_HEADER
    headers = [e for e in events if e.name == schema.HEADER]
    assert [h.pid for h in headers] == [child.pid] and headers[0].args["source"] == "sampler"
    counters = [e for e in events if e.name == schema.MEMORY_COUNTER]
    assert len(counters) >= 5
    assert all(e.args["rss_bytes"] > 0 and e.cat == schema.CAT_SAMPLER for e in counters)
    assert events[-1].name == schema.TRACE_END


def test_watch_appends_to_a_trace_that_kvdoctor_run_is_still_writing(spawn, tmp_path, capsys):
    from kvdoctor.trace.writer import TraceWriter

    trace = str(tmp_path / "run.kvtrace.json")
    writer = TraceWriter(trace)
    header = schema.header_event(pid=4242, engine="", engine_version="", process_title="kvdoctor run", extra={"command": ["x"]})
    header.name = schema.RUN_HEADER
    writer.write_batch([header])
    child = spawn(EXITER)
    assert watch(child.pid, interval_s=0.2, duration_s=5, trace_path=trace, output_format="json") == 0
    capsys.readouterr()
    writer.write_batch([schema.Event(ph="C", name=schema.LEDGER_COUNTER, pid=4242, ts=1.0, args={"free": 1})])
    writer.close()
    stats = ReadStats()
    events = list(iter_events(trace, stats))
    assert events[0].args["process_title"] == "kvdoctor run"  # the owner's header stays first
    assert sum(1 for e in events if e.name == schema.RUN_HEADER) == 2
    assert any(e.name == schema.MEMORY_COUNTER and e.pid == child.pid for e in events)
    assert events[-1].name == schema.LEDGER_COUNTER and not stats.clean_end  # left open for its owner


def test_sampler_follows_children_that_appear_and_exit(spawn):
    root = spawn(TREE)
    seen: list[schema.Event] = []
    sampler = Sampler(root.pid, interval_s=0.1, emit=seen.extend, tree_refresh_s=0.2)
    sampler.run(duration_s=15)
    assert not sampler.root_alive
    headers = {e.pid: e for e in seen if e.name == schema.HEADER}
    assert root.pid in headers and len(headers) == 2, headers
    child_pid = next(pid for pid in headers if pid != root.pid)
    assert headers[child_pid].args["role"] == "scheduler"
    assert headers[child_pid].args["ppid"] == root.pid
    assert headers[child_pid].args["engine"] == "sglang"
    child_counters = [e for e in seen if e.name == schema.MEMORY_COUNTER and e.pid == child_pid]
    root_counters = [e for e in seen if e.name == schema.MEMORY_COUNTER and e.pid == root.pid]
    assert child_counters and len(root_counters) > len(child_counters)  # the child left before the root
    assert child_pid in sampler.exited


def test_nonexistent_pid_is_a_kvdoctor_error(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for pid in (gone.pid, 999_999_999, 0, -3):
        with pytest.raises(KvdoctorError) as info:
            watch(pid, duration_s=1, trace_path=str(tmp_path / "x.kvtrace.json"))
        assert f"no process with pid {pid}" in info.value.message
        assert "ps" in info.value.hint
    assert not os.path.exists(tmp_path / "x.kvtrace.json")


def test_bad_arguments_are_kvdoctor_errors(tmp_path):
    with pytest.raises(KvdoctorError):
        watch(os.getpid(), interval_s=0, duration_s=1, trace_path=str(tmp_path / "a.kvtrace.json"))
    with pytest.raises(KvdoctorError):
        watch(os.getpid(), duration_s=1, output_format="yaml", trace_path=str(tmp_path / "a.kvtrace.json"))
    not_a_trace = tmp_path / "notes.txt"
    not_a_trace.write_text("my notes\n")
    with pytest.raises(KvdoctorError):
        watch(os.getpid(), duration_s=1, trace_path=str(not_a_trace))
    assert not_a_trace.read_text() == "my notes\n"


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"), reason="needs root to start processes as two other users")
def test_process_of_another_user_is_a_kvdoctor_error_with_a_hint(spawn):
    target = spawn("import time; print('ready', flush=True); time.sleep(60)", python="/usr/bin/python3", user=65534, cwd="/")
    checker = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from kvdoctor.collect.procfs import check_process
        from kvdoctor.errors import KvdoctorError
        try:
            check_process({target.pid})
        except KvdoctorError as exc:
            print("ERR", exc.one_line())
        else:
            print("OK")
        """
    )
    try:
        out = subprocess.run(["/usr/bin/python3", "-c", checker], user=65533, cwd="/", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot run as another user here: {exc}")
    if "ModuleNotFoundError" in out.stderr or "PermissionError" in out.stderr:
        pytest.skip("the repository is not readable by another user here")
    assert out.stdout.startswith("ERR"), out.stdout + out.stderr
    assert "another user" in out.stdout and "same user" in out.stdout


def test_attach_prints_one_line_and_watches_from_outside(spawn, tmp_path, capsys):
    child = spawn(EXITER)
    watch(child.pid, interval_s=0.2, duration_s=5, trace_path=str(tmp_path / "a.kvtrace.json"), output_format="json", attach=True)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "attach is not available" in ln]
    assert len(lines) == 1 and f"pid {child.pid}" in lines[0] and "kvdoctor run --" in lines[0]


def test_pinned_memory_is_read_from_dev_zero_shared_mappings(spawn):
    child = spawn(PINNED)
    reading = sample_process(child.pid, with_pinned=True)
    assert reading is not None
    assert reading["pinned_host_bytes"] >= 60 * MIB
    assert reading["pinned_host_bytes"] <= 70 * MIB  # the private anonymous mapping is not pinned
    assert reading["rss_shmem_bytes"] >= 60 * MIB  # shared /dev/zero is shmem to the kernel
    assert reading["rss_anon_bytes"] >= 60 * MIB
    assert reading["threads"] >= 1 and reading["open_files"] >= 3 and reading["cpu_s"] >= 0
    cheap = sample_process(child.pid, with_pinned=False)
    assert cheap["pinned_host_bytes"] is None
    child.kill()
    child.wait()
    assert sample_process(child.pid) is None


def test_sampler_reads_pinned_only_every_n_samples(spawn):
    child = spawn(PINNED)
    events: list[schema.Event] = []
    sampler = Sampler(child.pid, interval_s=0.01, emit=events.extend, pinned_every_n=5, pinned_cpu_fraction=1.0)
    for _ in range(20):
        sampler.sample_once()
    counters = [e for e in events if e.name == schema.MEMORY_COUNTER]
    with_pinned = [e for e in counters if "pinned_bytes" in e.args]
    assert len(counters) == 20 and len(with_pinned) == 4
    assert all(e.args["pinned_bytes"] >= 60 * MIB for e in with_pinned)
    # the title once, not in every sample (it is the whole command line: it made most of a sample's bytes)
    assert counters[0].args["title"] and not any("title" in e.args for e in counters[1:])


def test_find_process_tree_and_roles(spawn):
    child = spawn("import time; print('ready', flush=True); time.sleep(60)", "sglang::detokenizer")
    tree = find_process_tree(child.pid)
    assert [p.pid for p in tree] == [child.pid]
    assert "sglang::detokenizer" in tree[0].title and tree[0].role == "detokenizer"
    assert find_process_tree(999_999_999) == []
    assert find_process_tree(os.getpid())[0].pid == os.getpid()
    plain = spawn("import time; print('ready', flush=True); time.sleep(60)")  # a test runner may retitle itself
    assert find_process_tree(plain.pid)[0].role == "python"
    assert guess_role("sglang::scheduler_TP0") == "scheduler"
    assert guess_role("sglang::tokenizer") == "tokenizer"
    assert guess_role("VLLM::EngineCore") == "engine"
    assert guess_role("VLLM::Worker_TP1") == "worker"
    assert guess_role("/usr/bin/python3 -m sglang.launch_server") == "python"
    assert guess_role("nginx: worker process") == "other"


def test_machine_memory_limit_is_positive_and_at_most_ram():
    limit = machine_memory_limit_bytes()
    with open("/proc/meminfo") as fh:
        total = int(next(ln for ln in fh if ln.startswith("MemTotal:")).split()[1]) * 1024
    assert limit is not None and 0 < limit <= total
    assert machine_memory_limit_bytes(os.getpid()) == limit


def test_live_view_renders_a_row_per_process(spawn):
    from rich.console import Console

    child = spawn(GROWER, "20", "40")
    detector = MemoryGrowthDetector(FAST)
    sampler = Sampler(child.pid, interval_s=0.05, emit=lambda evs: [detector.feed(e) for e in evs])
    for _ in range(8):
        sampler.sample_once()
        time.sleep(0.05)
    view = LiveView(sampler, detector, child.pid)
    out = io.StringIO()
    Console(file=out, width=220, force_terminal=False).print(view.table())
    text = out.getvalue()
    assert str(child.pid) in text and "rss trend" in text and "MiB" in text
    assert sparkline([1, 2, 3, 4]) == "▁▃▆█" and sparkline([5, 5]) == "▁▁" and sparkline([]) == ""


# --------------------------------------------------------------------------- growth math, fake clock


class FakeClock:
    """Sample times at a fixed rate, with no real time passing."""

    def __init__(self, hz: float, start_s: float = 1_000.0) -> None:
        self.dt_s = 1.0 / hz
        self.now_s = start_s

    def ticks(self, duration_s: float) -> list[float]:
        out = []
        for _ in range(int(round(duration_s / self.dt_s))):
            out.append(self.now_s)
            self.now_s += self.dt_s
        return out


def _first_flag_s(times: list[float], values: list[float], warmup_s: float, step_s: float = 1.0) -> float | None:
    """Seconds of post-warm-up data after which detect_growth first flags the series."""
    t0 = times[0]
    checked = warmup_s + step_s
    while checked <= times[-1] - t0 + 1e-9:
        n = sum(1 for t in times if t - t0 <= checked)
        if growth.detect_growth(times[:n], values[:n], warmup_s=warmup_s):
            return checked - warmup_s
        checked += step_s
    return None


@pytest.mark.parametrize("hz", [1.0, 10.0])
def test_ten_gb_per_hour_leak_is_flagged_within_two_minutes_after_warmup(hz):
    rng = random.Random(7)
    clock = FakeClock(hz)
    times = clock.ticks(60 + 180)
    rate = 10 * GB / 3600
    # a warm-up bump, then a steady leak under allocator noise
    values = [4 * GB + 2 * GB * (1 - math.exp(-(t - times[0]) / 10)) + rate * (t - times[0]) + rng.gauss(0, 20 * MIB) for t in times]
    flagged_after = _first_flag_s(times, values, warmup_s=60)
    assert flagged_after is not None and flagged_after <= 120, flagged_after
    result = growth.detect_growth(times, values, warmup_s=60)
    assert result is not None
    assert abs(result.bytes_per_s - rate) / rate < 0.1
    assert abs(result.bytes_per_hour - 10 * GB) / (10 * GB) < 0.1
    assert result.lower_bytes_per_s <= result.bytes_per_s <= result.upper_bytes_per_s
    assert result.window_start_s >= times[0] + 60 and result.window_end_s == times[-1]
    assert result.samples == sum(1 for t in times if t >= times[0] + 60)


def test_flat_plateau_is_not_flagged():
    times = FakeClock(1).ticks(900)
    values = [3 * GB] * len(times)
    assert growth.detect_growth(times, values) is None


@pytest.mark.parametrize("seed", range(10))
def test_noisy_plateau_is_not_flagged(seed):
    rng = random.Random(seed)
    times = FakeClock(1).ticks(900)
    values = [3 * GB + rng.gauss(0, 30 * MIB) for _ in times]
    for end in range(120, 901, 60):
        assert growth.detect_growth(times[:end], values[:end]) is None, end


def test_step_up_then_flat_is_not_flagged():
    rng = random.Random(3)
    times = FakeClock(1).ticks(900)
    values = [3 * GB + (1 * GB if t - times[0] > 200 else 0) + rng.gauss(0, 5 * MIB) for t in times]
    assert growth.detect_growth(times, values) is None
    exact = [3 * GB + (1 * GB if t - times[0] > 200 else 0) for t in times]
    assert growth.detect_growth(times, exact) is None


def test_cache_that_fills_and_stops_is_not_flagged_once_it_flattens():
    times = FakeClock(1).ticks(900)
    values = [3 * GB + 4 * GB * (1 - math.exp(-(t - times[0]) / 90)) for t in times]  # still rising, ever slower
    assert growth.detect_growth(times, values) is None


def test_leak_that_starts_late_in_a_long_watch_is_found():
    times = FakeClock(1).ticks(4 * 3600)
    start = times[0] + 3 * 3600
    rate = 2 * GB / 3600
    values = [3 * GB + max(0.0, t - start) * rate for t in times]
    result = growth.detect_growth(times, values)
    assert result is not None and result.window_start_s >= start - 3600
    assert abs(result.bytes_per_s - rate) / rate < 0.1


def test_slow_drift_below_the_minimum_rate_is_not_flagged():
    times = FakeClock(1).ticks(3600)
    values = [3 * GB + 10 * MIB / 3600 * (t - times[0]) for t in times]  # 10 MiB/h
    assert growth.detect_growth(times, values) is None
    assert growth.detect_growth(times, values, min_rate_bytes_per_s=1 * MIB / 3600, min_rise_bytes=0) is not None  # 10 MiB in all


def test_warmup_counts_from_origin():
    times = FakeClock(1).ticks(200)
    values = [3 * GB + 1 * MIB * (t - times[0]) for t in times]
    assert growth.detect_growth(times, values, warmup_s=180) is None  # only 20 s left: too short
    assert growth.detect_growth(times, values, warmup_s=180, origin_s=times[0] - 170) is not None


def test_theil_sen_ignores_outliers_and_bounds_the_slope():
    rng = random.Random(1)
    times = [float(i) for i in range(300)]
    values = [5.0 * t + rng.gauss(0, 1) for t in times]
    for i in range(0, 300, 7):
        values[i] += 10_000  # spikes a least-squares fit would follow
    est = growth.theil_sen(times, values)
    assert est is not None and abs(est.slope - 5.0) < 0.1
    assert est.lower < 5.0 < est.upper


def test_theil_sen_without_numpy_matches(monkeypatch):
    rng = random.Random(2)
    times = [i * 0.5 for i in range(500)]
    values = [3.0 * t + rng.gauss(0, 2) for t in times]
    with_numpy = growth.theil_sen(times, values)
    monkeypatch.setattr(growth, "_np", None)
    without = growth.theil_sen(times, values)
    assert with_numpy is not None and without is not None
    assert abs(with_numpy.slope - without.slope) < 0.05 and without.points <= 200


@settings(max_examples=40, deadline=None)
@given(slope=st.floats(-1e7, 1e7, allow_nan=False), offset=st.floats(0, 1e11, allow_nan=False), n=st.integers(3, 400))
def test_theil_sen_recovers_an_exact_line(slope, offset, n):
    times = [i * 0.1 for i in range(n)]
    est = growth.theil_sen(times, [offset + slope * t for t in times])
    assert est is not None
    assert math.isclose(est.slope, slope, rel_tol=1e-6, abs_tol=1e-3)


def test_time_to_oom():
    assert growth.time_to_oom_s(6 * GB, 1 * GB / 3600, 8 * GB) == pytest.approx(7200)
    assert growth.time_to_oom_s(9 * GB, 1.0, 8 * GB) == 0.0
    assert growth.time_to_oom_s(1 * GB, 0.0, 8 * GB) is None
    assert growth.time_to_oom_s(1 * GB, -5.0, 8 * GB) is None
    assert growth.time_to_oom_s(1 * GB, 5.0, None) is None


def test_detect_growth_rejects_mismatched_input():
    with pytest.raises(ValueError):
        growth.detect_growth([1.0, 2.0], [1.0])
    assert growth.detect_growth([], []) is None


# --------------------------------------------------------------------------- the detector on events


def _counter(pid: int, t_s: float, **args) -> schema.Event:
    return schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=pid, ts=t_s * 1e6, cat=schema.CAT_SAMPLER, args=args)


def _feed_series(detector: MemoryGrowthDetector, pid: int, seconds: int, make_args) -> None:
    for k in range(seconds):
        detector.feed(_counter(pid, 1_700_000_000.0 + k, **make_args(k)))


def test_detector_reports_the_narrowest_class_once():
    detector = MemoryGrowthDetector(memory_limit_bytes=64 * 2**30)
    detector.feed(
        schema.header_event(
            pid=11, engine="sglang", engine_version="", process_title="sglang::scheduler", extra={"process_start_s": 1_700_000_000.0 - 3600}
        )
    )
    leak = 10 * GB / 3600
    _feed_series(
        detector,
        11,
        300,
        lambda k: {"anon_bytes": 2 * GB + leak * k, "rss_bytes": 3 * GB + leak * k, "shmem_bytes": 1 * GB, "file_bytes": 0},
    )
    # pinned grows, and so does shmem which contains it, and rss which contains that
    _feed_series(
        detector,
        12,
        300,
        lambda k: {
            "anon_bytes": 1 * GB,
            "rss_bytes": 2 * GB + leak * k,
            "shmem_bytes": 1 * GB + leak * k,
            "pinned_bytes": 0.5 * GB + leak * k,
            "file_bytes": 0,
            "title": "sglang::detokenizer",
        },
    )
    # only rss grows (file-backed growth, say): rss stands in
    _feed_series(detector, 13, 300, lambda k: {"anon_bytes": 1 * GB, "rss_bytes": 2 * GB + leak * k})
    findings = detector.findings()
    got = sorted((f.pid, f.evidence["memory_class"]) for f in findings)
    assert got == [(11, "anon"), (12, "pinned"), (13, "rss")]
    first = next(f for f in findings if f.pid == 11)
    assert first.kind == "memory_growth" and first.severity == "error"
    assert first.message.startswith("sglang::scheduler (pid 11) anonymous memory grows 9.")
    assert "reaches the memory limit in" in first.message
    ev = first.evidence
    for key in (
        "bytes_per_s",
        "bytes_per_hour",
        "lower_bound_bytes_per_s",
        "window_start_s",
        "window_end_s",
        "memory_class",
        "process_title",
        "pid",
        "samples",
        "current_bytes",
        "time_to_oom_s",
    ):
        assert key in ev
    assert ev["process_title"] == "sglang::scheduler"
    assert ev["samples"] == 300  # the process started an hour earlier: nothing is warm-up
    assert next(f for f in findings if f.pid == 12).evidence["process_title"] == "sglang::detokenizer"
    json.dumps([f.to_dict() for f in findings])


def test_detector_gpu_growth_uses_the_gpu_total():
    detector = MemoryGrowthDetector(growth.GrowthParams(warmup_s=0))
    _feed_series(detector, 21, 200, lambda k: {"rss_bytes": 1 * GB, "gpu_bytes": 10 * GB + 5 * MIB * k, "gpu_total_bytes": 80 * GB})
    (finding,) = detector.findings()
    assert finding.evidence["memory_class"] == "gpu"
    assert finding.evidence["limit_bytes"] == 80 * GB
    expected = (80 * GB - (10 * GB + 5 * MIB * 199)) / (5 * MIB)
    assert finding.evidence["time_to_oom_s"] == pytest.approx(expected, rel=0.05)
    assert "reaches the GPU's memory in" in finding.message


def test_detector_memory_stays_bounded():
    detector = MemoryGrowthDetector(growth.GrowthParams(warmup_s=0), max_points_per_series=20_000)
    for k in range(50_000):
        detector.feed(_counter(31, 1_700_000_000.0 + k * 0.1, rss_bytes=1 * GB + k * 4096, anon_bytes=1 * GB + k * 4096))
    times, values = detector.series(31, "anon")
    assert 10_000 <= len(times) <= 20_000
    assert times == sorted(times) and times[-1] >= 1_700_000_000.0 + 4990
    started = time.perf_counter()
    findings = detector.findings()
    assert time.perf_counter() - started < 5.0
    assert [f.evidence["memory_class"] for f in findings] == ["anon"]


def test_detector_ignores_other_events_and_junk():
    detector = MemoryGrowthDetector()
    detector.feed(schema.Event(ph="i", name=schema.VIOLATION, pid=1, args={"kind": "double_free"}))
    detector.feed(_counter(1, 1.0, rss_bytes="lots", anon_bytes=None, gpu_bytes=float("nan")))
    detector.feed(_counter(1, 2.0, rss_bytes=True))
    assert detector.findings() == []


def test_check_process_accepts_our_own_process():
    check_process(os.getpid())


def test_live_view_screenshot(tmp_path):
    """The live table as a user sees it: a growing scheduler's row flagged in red with its rate and
    time to OOM, a flat detokenizer beside it; drawn by rich, exported as SVG, shot by Chromium."""
    from PIL import Image
    from rich.console import Console
    from support.browser import CHROMIUM, chromium

    detector = MemoryGrowthDetector(FAST)
    gib, mib = 1 << 30, 1 << 20
    detector.feed(schema.Event(ph="M", name=schema.RUN_HEADER, pid=1, args={"memory_limit_bytes": 64 * gib}))
    for second in range(240):  # four minutes at 1 Hz: the scheduler grows 10 GiB/h, the detokenizer is flat
        anon = 2 * gib + second * 10 * gib // 3600 + (second % 7) * mib
        detector.feed(_counter(4242, second, anon_bytes=anon, rss_bytes=anon + 90 * mib))
        detector.feed(_counter(4343, second, anon_bytes=300 * mib + (second % 5) * mib, rss_bytes=390 * mib))
    procs = {
        pid: SimpleNamespace(info=SimpleNamespace(pid=pid, title=title))
        for pid, title in ((4242, "sglang::scheduler_TP0"), (4343, "sglang::detokenizer"))
    }
    console = Console(record=True, width=120, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    with LiveView(SimpleNamespace(rounds=240, processes=procs), detector, 4242, console=console):
        pass  # leaving the view draws it once more, with the growth test run
    text = console.export_text(clear=False)
    assert "sglang::scheduler_TP0" in text and "sglang::detokenizer" in text
    scheduler_row = next(line for line in text.splitlines() if line.strip().startswith("4242"))
    assert "/h !" in scheduler_row and "—" not in scheduler_row.split("/h !")[1]  # flagged, with a time to OOM
    svg = tmp_path / "watch.svg"
    svg.write_text(console.export_svg(title="kvdoctor watch"), encoding="utf-8")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed: no screenshot of the live view")
    png = tmp_path / "watch.png"
    chromium(tmp_path, f"--screenshot={png}", "--window-size=1100,700", svg.as_uri())
    image = Image.open(png).convert("RGB")
    pixels = list(image.getdata())
    reddish = sum(1 for r, g, b in pixels if r > 150 and g < 110 and b < 110)
    assert len(set(pixels)) > 32 and reddish > 200, f"{len(set(pixels))} colours, {reddish} red pixels"
