"""An analysis holds bounded memory whatever the trace names, and a bound never drops a finding
(#27 items 8 and 10).

A trace naming more processes than one analysis holds keeps those the probe counted slots in
and sets aside the ones that only have memory samples; a trace naming 100k allocators keeps the
first of each table and counts the rest, in the notes and in one finding that carries their count.
The traces are written with the trace writer, the way the sampler and the probe write them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from kvdoctor.analysis.admission import MAX_PROCESSES
from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace

FLEET = 5000  # more processes than one analysis holds
LATE_PID = 99_999


def kv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=300)


def peak_rss_of(args: list[str]) -> tuple[int, subprocess.CompletedProcess]:
    """The peak RSS of `kvdoctor ARGS` in bytes (its own process, measured by its parent), and its result."""
    code = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    return int(proc.stdout.strip().splitlines()[-1]), proc


def sampled_process(pid: int) -> list[schema.Event]:
    """A process the sampler followed: its header, then memory samples."""
    header = schema.header_event(
        pid=pid, engine="", engine_version="", process_title=f"python worker {pid}", extra={"source": "sampler", "ppid": 1}
    )
    header.cat = schema.CAT_SAMPLER
    samples = [
        schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=pid, ts=1e12 + k * 1e6, cat=schema.CAT_SAMPLER, args={"rss_bytes": 1 << 27})
        for k in range(3)
    ]
    return [header, *samples]


def probed_process(pid: int, title: str = "sglang::scheduler") -> list[schema.Event]:
    """A process the probe reported from: its header and its ledger's counter."""
    header = schema.header_event(pid=pid, engine="sglang", engine_version="0.5.23", process_title=title, extra={"probe": "kvdoctor"})
    slots = schema.Event(
        ph="C", name=schema.LEDGER_COUNTER, pid=pid, ts=1e12, args={"allocator": "A#0", "free_slots": 64, "owned_slots": 0}
    )
    return [header, slots]


def census(pid: int, orphans: int, allocator: str = "TokenToKVPoolAllocator#0", ts: float = 2e12) -> schema.Event:
    args = {"allocator": allocator, "reason": "exit", "idle": True, "orphan_slots": orphans, "orphan_slot_ids": list(range(orphans))}
    return schema.Event(ph="i", name=schema.CENSUS, pid=pid, ts=ts, args=args)


def write(path, events) -> str:
    writer = TraceWriter(str(path))
    for start in range(0, len(events), 10_000):
        writer.write_batch(events[start : start + 10_000])
    writer.close()
    finish_trace(str(path), LATE_PID)
    return str(path)


# ---------------------------------------------------------------- 8: more processes than one analysis holds


@pytest.mark.parametrize("fleet", ["sampled", "probed"])
def test_a_late_leak_is_found_past_a_fleet_of_processes(tmp_path, fleet):
    """5000 processes first (the sampler's, or ones the probe only reported from), then the
    scheduler and its 50-slot leak: the leak used to be dropped (replay said clean, a note only)."""
    events = []
    for pid in range(1000, 1000 + FLEET):
        events += sampled_process(pid) if fleet == "sampled" else probed_process(pid, f"worker {pid}")
    events += [*probed_process(LATE_PID), census(LATE_PID, 50)]
    path = write(tmp_path / "fleet.kvtrace.json", events)
    replay = kv("replay", path)
    assert replay.returncode == 1, replay.stdout[-3000:]
    assert "ERROR orphan_slots x50" in replay.stdout
    assert f"the trace names more than {MAX_PROCESSES} processes" in replay.stdout  # and says what it set aside
    assert "were set aside for processes whose slots the probe counted" in replay.stdout
    gate = kv("gate", path)
    assert gate.returncode == 1 and "FAIL  max-orphan-slots: 50 orphaned KV slot(s)" in gate.stdout, gate.stdout[-3000:]


def test_processes_the_analysis_has_no_room_for_are_no_pass(tmp_path):
    """5000 processes each with a clean census fill every place: the late leak finds none. It is
    not found, but the gate says so and cannot pass (it could say PASS before)."""
    events = []
    for pid in range(1000, 1000 + FLEET):
        events += [*probed_process(pid, f"worker {pid}"), census(pid, 0, ts=1.5e12)]
    events += [*probed_process(LATE_PID), census(LATE_PID, 50)]
    path = write(tmp_path / "counted.kvtrace.json", events)
    gate = kv("gate", path)
    assert gate.returncode == 2, gate.stdout[-3000:]
    assert "N/A   every-process-analysed:" in gate.stdout and "COULD NOT JUDGE" in gate.stdout
    replay = kv("replay", path)
    assert "processes whose slots the probe counted" in replay.stdout and "every slot is accounted for" not in replay.stdout


# ---------------------------------------------------------------- 10: more allocators than one analysis keeps

LABELS = 100_000
LEAKING_LEDGERS = 3000  # more than the 1024 a detector names one by one


@pytest.fixture(scope="module")
def many_labels(tmp_path_factory):
    """One scheduler whose ledger counters name 100k allocators, 3000 of which leak one slot each
    and see one double free each."""
    events = probed_process(LATE_PID)
    for i in range(LABELS):
        args = {"allocator": f"TokenToKVPoolAllocator#{i}", "free_slots": 100, "owned_slots": 0, "tree_slots": 0}
        events.append(schema.Event(ph="C", name=schema.LEDGER_COUNTER, pid=LATE_PID, ts=1e12 + i, args=args))
    for i in range(LEAKING_LEDGERS):
        events.append(census(LATE_PID, 1, allocator=f"TokenToKVPoolAllocator#{i}"))
        violation = {"kind": schema.DOUBLE_FREE, "count": 1, "allocator": f"TokenToKVPoolAllocator#{i}", "site": "free", "slot_ids": [i]}
        events.append(schema.Event(ph="i", name=schema.VIOLATION, pid=LATE_PID, ts=2e12, args=violation))
    return write(tmp_path_factory.mktemp("labels") / "labels.kvtrace.json", events)


def test_many_allocators_make_a_bounded_report_in_bounded_memory(many_labels, tmp_path):
    """The HTML report of a trace naming 100k allocators used to hold every series and plot each
    (5.7 GB and an 894 MB file at 400k); now at most a few of each kind, and the rest counted."""
    html = tmp_path / "report.html"
    peak, proc = peak_rss_of(["replay", many_labels, "--format", "html", "-o", str(html)])
    assert "wrote html report" in proc.stderr, proc.stderr[-3000:]
    assert os.path.getsize(html) < 2 << 20, f"{os.path.getsize(html) >> 10} KiB"
    assert peak < 400 << 20, f"peak RSS {peak >> 20} MiB"
    text = html.read_text()
    rest = LABELS + 1 - 128  # the scheduler's own allocator too, less the 128 plotted
    assert f"128 are kept for the plots, {rest} more ({rest} event(s)) are not plotted" in text
    assert "more series not drawn" in text


def test_no_count_is_lost_past_the_tables_bounds(many_labels):
    """Past 1024 ledgers a detector names no more one by one, but their counts stay: the gate
    counts every leaked slot and every double free."""
    gate = kv("gate", many_labels)
    assert gate.returncode == 1
    assert f"FAIL  max-orphan-slots: {LEAKING_LEDGERS} orphaned KV slot(s)" in gate.stdout, gate.stdout[-3000:]
    assert f"FAIL  no-double_free: {LEAKING_LEDGERS} double_free event(s)" in gate.stdout
    replay = kv("replay", many_labels)
    assert f"more KV slot(s) leaked, at the latest census of {LEAKING_LEDGERS - 1024} (process, allocator) ledgers" in replay.stdout
    assert "more orphan_slots finding(s)" in replay.stdout  # the report shows the largest, and counts the rest
    assert len(replay.stdout) < 64 << 10
