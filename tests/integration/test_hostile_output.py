"""What a hostile trace or a careless pipeline does to kvdoctor's output (#27 items 11 and 12).

Each test is one way a command used to end in "internal error" (a growth fit on absurd numbers, a
reader that went away, an ASCII-only stdout, an unreadable file), hang (a FIFO given as a trace),
turn a gate FAIL into exit 2, or let text a client chose (a request id, a process title, a call
site) forge report lines, GitHub workflow commands or a reversed line on the terminal. Every
command runs as a user runs it, in its own process, on traces written by the trace writer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from conftest import REPO

from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace


def kv(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout, env=env)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvdoctor: "), (proc.returncode, proc.stderr[-2000:])
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    return lines[0]


def write_trace(path, events, *, title="sglang::scheduler") -> str:
    """A trace as the probe writes one: its header, `events`, the end marker."""
    writer = TraceWriter(str(path))
    header = schema.header_event(pid=7, engine="sglang", engine_version="0.5.23", process_title=title, extra={"probe": "kvdoctor"})
    writer.write_batch([header, *events])
    writer.close()
    finish_trace(str(path), 7)
    return str(path)


def leak_census(orphans: int = 12, **extra) -> schema.Event:
    args = {"allocator": "TokenToKVPoolAllocator#0", "reason": "exit", "idle": True, "orphan_slots": orphans}
    args["orphan_slot_ids"] = list(range(orphans))
    return schema.Event(ph="i", name=schema.CENSUS, pid=7, ts=2e12, args={**args, **extra})


def memory(values) -> list[schema.Event]:
    return [
        schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=7, ts=1e12 + i * 10e6, args={"anon_bytes": v, "rss_bytes": v})
        for i, v in enumerate(values)
    ]


# ---------------------------------------------------------------- 11: absurd numbers


ABSURD = {
    "1e300-rising": [1e300 * (1 + i / 400) for i in range(400)],  # each a float, all beyond any memory
    "1e300-mixed": [1e300 if i % 3 else 1e9 + i * 1e7 for i in range(400)],  # mixed with plausible ones
    "near-max-float": [1.7e308 - i * 1e300 for i in range(400)],  # near the largest float: differences overflow
}


@pytest.mark.parametrize("values", ABSURD.values(), ids=ABSURD.keys())
@pytest.mark.parametrize("counter", [schema.MEMORY_COUNTER, schema.MEMORY_CLASSES])
def test_absurd_memory_values_leave_the_report_whole(tmp_path, values, counter):
    """A memory series of ~1e300 "bytes" used to overflow the growth fit into NaN and take the
    whole report down (internal error, exit 2); such points are no machine's memory and are left
    out of the fit, and the census's leak is still reported. (In one process: the fit is the
    analysis's; the command line is the next test's.)"""
    from kvdoctor.analysis.replay import analyze_trace
    from kvdoctor.formats.reports import render

    events = memory(values)
    if counter == schema.MEMORY_CLASSES:
        for event in events:
            event.name, event.args = counter, {"python_heap_bytes": event.args["anon_bytes"], "anon_bytes": event.args["anon_bytes"]}
    analysis = analyze_trace(write_trace(tmp_path / "absurd.kvtrace.json", [*events, leak_census()]))
    assert schema.ORPHAN_SLOTS in [f.kind for f in analysis.errors]
    for fmt in ("text", "json", "html"):
        assert "orphan_slots" in render(analysis, fmt)


def test_absurd_memory_values_through_the_command_line(tmp_path):
    path = write_trace(tmp_path / "absurd.kvtrace.json", [*memory(ABSURD["1e300-mixed"]), leak_census()])
    proc = kv("replay", path, "--format", "html")
    assert proc.returncode == 1 and "internal error" not in proc.stderr, proc.stderr[-2000:]


def test_a_plausible_series_beside_absurd_points_still_grows(tmp_path):
    """Leaving absurd points out does not hide the growth of the rest."""
    values = [1e300 if i % 5 == 0 else 1e9 + i * 1e7 for i in range(400)]
    proc = kv("replay", write_trace(tmp_path / "t.kvtrace.json", memory(values)))
    assert proc.returncode == 1 and "memory_growth" in proc.stdout, proc.stdout + proc.stderr[-1500:]


# ---------------------------------------------------------------- 11: a reader that goes away


def _with_closed_stdout(*args: str) -> subprocess.CompletedProcess:
    """Runs kvdoctor with stdout a pipe whose read end is already closed: every write to it fails
    with EPIPE, the way `| head -c 1` ends, but without depending on when head exits."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvdoctor.cli", *args], stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=120
        )
    finally:
        os.close(write_end)


@pytest.fixture(scope="module")
def leak_trace(tmp_path_factory):
    return write_trace(tmp_path_factory.mktemp("leak") / "leak.kvtrace.json", [*memory([1e9] * 5), leak_census()])


@pytest.mark.parametrize(
    "args,code",
    [
        (["gate", "{trace}"], 1),  # a FAIL stays 1 (it used to become 2)
        (["replay", "{trace}"], 1),
        (["export", "{trace}", "-o", "-"], 0),
        (["fixes"], 0),
    ],
    ids=["gate", "replay", "export", "fixes"],
)
def test_a_reader_that_went_away_keeps_the_exit_code(leak_trace, args, code):
    proc = _with_closed_stdout(*[a.format(trace=leak_trace) for a in args])
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "internal error" not in proc.stderr and "BrokenPipe" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_watch_with_a_reader_that_went_away(fmt, tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    trace = str(tmp_path / "watch.kvtrace.json")  # not watch's default, a file in the working folder
    try:
        proc = _with_closed_stdout("watch", str(sleeper.pid), "--duration", "1", "--interval", "0.2", "--format", fmt, "--trace", trace)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "internal error" not in proc.stderr and "BrokenPipe" not in proc.stderr


# ---------------------------------------------------------------- 11: an ASCII-only stdout


def test_an_ascii_only_stdout_gets_escapes_not_an_error(tmp_path):
    """A growth finding says "≥"; under PYTHONIOENCODING=ascii (or a C locale) it used to be an
    internal error with exit 2."""
    path = write_trace(tmp_path / "t.kvtrace.json", memory([1e9 + i * 1e7 for i in range(400)]))
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    for args in (["replay", path], ["gate", path], ["replay", path, "--format", "html"]):
        proc = kv(*args, env=env)
        assert proc.returncode == 1 and "internal error" not in proc.stderr, (args, proc.stderr[-1500:])
        proc.stdout.encode("ascii")  # nothing but ASCII reached the stream
    assert "\\u2265" in kv("replay", path, env=env).stdout


# ---------------------------------------------------------------- 11: files that are no trace


def test_an_unreadable_file_is_one_line(tmp_path):
    assert "/proc/self/mem: cannot be read" in one_line_error(kv("replay", "/proc/self/mem"))
    assert "cannot be read" in one_line_error(kv("export", "/proc/self/mem", "-o", str(tmp_path / "x.csv")))


@pytest.mark.parametrize(
    "args",
    [["replay", "{fifo}"], ["gate", "{fifo}"], ["gate", "--baseline", "{fifo}", "{trace}"], ["export", "{fifo}", "-o", "-"]],
    ids=["replay", "gate", "gate-baseline", "export"],
)
def test_a_fifo_is_refused_not_waited_on(tmp_path, leak_trace, args):
    """Opening a FIFO for reading waits for a writer that never comes: `replay` and `gate` used
    to hang. It is refused at once, with one line (the timeout fails the test if it hangs)."""
    fifo = str(tmp_path / "trace.kvtrace.json")
    os.mkfifo(fifo)
    line = one_line_error(kv(*[a.format(fifo=fifo, trace=leak_trace) for a in args], timeout=60))
    assert "is a FIFO (named pipe), not a trace file" in line


def test_a_device_is_refused(leak_trace):
    assert "/dev/null: is a device" in one_line_error(kv("replay", "/dev/null"))
    assert "/dev/zero: is a device" in one_line_error(kv("gate", "--baseline", "/dev/zero", leak_trace))


# ---------------------------------------------------------------- 12: text a client chose

RID = "r1\n  PASS  max-orphan-slots: 0 forged\r\n::error title=forged::owned\u202egnp.exe\u2066\u200f"
TITLE = "sglang::scheduler\n::warning::forged title\u202e"
SITE = "_prefill (x.py:1)\n::error::forged site"


@pytest.fixture(scope="module")
def crafted_trace(tmp_path_factory):
    """A double free and a leak whose request id, process title and call site carry newlines, a
    carriage return, workflow commands and bidirectional controls."""
    violation = schema.Event(
        ph="i",
        name=schema.VIOLATION,
        pid=7,
        ts=1e12,
        args={
            "kind": schema.DOUBLE_FREE,
            "count": 2,
            "allocator": "A#0",
            "site": SITE,
            "slot_ids": [1, 2],
            "requests": {f"req_pool_idx 3 (rid {RID})": 2},
        },
    )
    census = leak_census(4, orphan_requests={f"req_pool_idx 5 (rid {RID})": 4}, orphan_allocated_at={SITE: 4})
    return write_trace(tmp_path_factory.mktemp("crafted") / "crafted.kvtrace.json", [violation, census], title=TITLE)


def _assert_no_forged_lines(out: str) -> None:
    for line in out.splitlines():
        assert not line.startswith("::"), line
        assert "forged" not in line or not line.lstrip().startswith(("PASS", "::")), line
    for char in "\r\u202e\u2066\u200f":
        assert char not in out


def test_a_request_id_cannot_forge_report_lines(crafted_trace):
    proc = kv("replay", crafted_trace)
    assert proc.returncode == 1
    _assert_no_forged_lines(proc.stdout)
    assert "r1\\x0a  PASS  max-orphan-slots: 0 forged\\x0d\\x0a::error title=forged::owned\\u202egnp.exe" in proc.stdout
    assert "sglang::scheduler\\x0a::warning::forged" in proc.stdout  # the title, cut at 40 characters


def test_a_request_id_cannot_forge_a_verdict_or_a_workflow_command(crafted_trace, tmp_path):
    junit = tmp_path / "j.xml"
    env = {**os.environ, "GITHUB_ACTIONS": "true"}
    proc = kv("gate", "--junit", str(junit), crafted_trace, env=env)
    assert proc.returncode == 1
    commands = [line for line in proc.stdout.splitlines() if line.startswith("::")]
    assert commands and all(line.startswith("::error title=kvdoctor gate::") for line in commands), commands
    body = [line for line in proc.stdout.splitlines() if not line.startswith("::")]
    _assert_no_forged_lines("\n".join(body))
    for line in commands:
        assert "\r" not in line and "\u202e" not in line
    marks = [line.split()[0] for line in body if line.startswith("  ")]
    assert set(marks) <= {"PASS", "FAIL", "N/A"}, marks
    root = ET.parse(junit).getroot()
    for element in root.iter():
        for text in [element.text or "", *element.attrib.values()]:
            assert "\n" not in text.strip("\n ") and "\u202e" not in text, text


def test_html_writes_bidirectional_controls_out(crafted_trace):
    proc = kv("replay", crafted_trace, "--format", "html")
    assert proc.returncode == 1 and "\u202e" not in proc.stdout and "\\u202e" in proc.stdout
