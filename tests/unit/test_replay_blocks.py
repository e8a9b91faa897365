"""The block replay (`analyze_trace`) against the line-by-line reader (`iter_events` + `analyze`):
the same findings, evidence, order, series and notes on varied and damaged traces."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
from conftest import REPO

from kvdoctor.analysis.analyzer import Analyzer, analyze
from kvdoctor.analysis.detectors.base import CounterBlockSink
from kvdoctor.analysis.replay import AnalyzerTarget, analyze_trace
from kvdoctor.errors import KvdoctorError
from kvdoctor.trace import block_replay, blocks, counter_block, schema
from kvdoctor.trace.reader import ReadStats, iter_events
from kvdoctor.trace.writer import TraceWriter, finish_trace
from kvdoctor.units import BoundedSeries


def varied_events(count: int, seed: int = 0) -> list[dict]:
    """Counters of several processes and allocators, memory that leaks in one of them, probe
    stats with drops, violations and censuses, headers met late, and odd but valid lines."""
    rng = random.Random(seed)
    out: list[dict] = []
    t = 1.7e15
    for i in range(count):
        t += rng.choice([10000, 10000, 10000.5, 7, 0])  # ties and tiny steps too
        pid = rng.choice([11, 11, 22, 33])
        r = rng.random()
        if i % 997 == 0:
            out.append(schema.header_event(pid=pid, engine="sglang", engine_version="1", process_title=f"proc {pid}").to_json_dict())
        elif r < 0.5:
            args = {"allocator": rng.choice(["A#0", "A#1", "B"]), "free_slots": rng.randrange(100000), "owned_slots": rng.randrange(10)}
            if rng.random() < 0.05:
                args["extra"] = rng.choice([1.5, -2, 0, 10**20 if rng.random() < 0.2 else 3])
            out.append({"ph": "C", "name": schema.LEDGER_COUNTER, "pid": pid, "tid": 1, "ts": t, "args": args})
        elif r < 0.8:
            args = {"rss_bytes": (8 << 30) + i * 5000 * (pid == 11), "anon_bytes": (6 << 30) + i * 4000 * (pid == 11) + rng.randrange(1000)}
            if rng.random() < 0.3:
                args["gpu_bytes"] = rng.choice([1 << 30, 0, 2.5e9])
                args["gpu_total_bytes"] = rng.choice([80 << 30, 0])
            if rng.random() < 0.2:
                args["title"] = rng.choice(["", f"sglang::scheduler_{pid}", "x y"])
            if rng.random() < 0.02:
                args["allocator"] = "odd"
            late = 25000 if rng.random() < 0.03 else 0  # a sample stamped before the last one
            out.append({"ph": "C", "name": schema.MEMORY_COUNTER, "pid": pid, "tid": 1, "ts": t / 1000 * 1000 - late, "args": args})
        elif r < 0.95:
            args = {"hooked_calls": i, "dropped_events": rng.choice([0, 0, 0, i % 50])}
            if rng.random() < 0.01:
                args["write_error"] = "disk full"
            out.append({"ph": "C", "name": schema.PROBE_STATS, "pid": pid, "tid": 1, "ts": t, "args": args})
        elif r < 0.98:
            out.append(
                {
                    "ph": "i",
                    "s": "p",
                    "name": schema.VIOLATION,
                    "pid": pid,
                    "tid": 1,
                    "ts": t,
                    "args": {"kind": schema.DOUBLE_FREE, "allocator": "A#0", "count": 2, "site": "free (x.py:1)", "slot_ids": [i, i + 1]},
                }
            )
        else:
            out.append(
                {
                    "ph": "i",
                    "name": schema.CENSUS,
                    "pid": pid,
                    "tid": 1,
                    "ts": t,
                    "args": {"allocator": "A#0", "orphan_slots": rng.choice([0, 3]), "orphan_slot_ids": [1, 2, 3], "reason": "idle"},
                }
            )
    return out


def write_trace(path: str, events: list[dict], *, finish: bool = True) -> bytes:
    writer = TraceWriter(path)
    writer.write_batch([schema.header_event(pid=11, engine="sglang", engine_version="1", process_title="main")])
    for start in range(0, len(events), 1000):
        writer.write_batch(events[start : start + 1000])  # type: ignore[arg-type]
    writer.close()
    if finish:
        finish_trace(path, 11)
    with open(path, "rb") as fh:
        return fh.read()


def line_by_line(path: str) -> dict:
    stats = ReadStats()
    analysis = analyze(iter_events(path, stats), source=path)
    analysis.notes = stats.notes()
    return {"report": analysis.to_dict(), "series": analysis.series}


def by_blocks(path: str) -> dict:
    analysis = analyze_trace(path)
    return {"report": analysis.to_dict(), "series": analysis.series}


def assert_same(path: str) -> dict:
    old, new = line_by_line(path), by_blocks(path)
    assert json.dumps(new, sort_keys=False) == json.dumps(old, sort_keys=False)
    return new


def outcome(read, path: str) -> object:
    """The analysis, or the one line a user would see."""
    try:
        return read(path)
    except KvdoctorError as exc:
        return exc.one_line()


@pytest.fixture
def gathered_blocks(monkeypatch):
    """The sizes of the counter blocks handed to the sinks in bulk, as they go."""
    sizes: list[int] = []
    feed = AnalyzerTarget.feed_block

    def counted(self, block):
        sizes.append(len(block))
        feed(self, block)

    monkeypatch.setattr(AnalyzerTarget, "feed_block", counted)
    return sizes


def test_every_bulk_feed_declares_the_protocol():
    """A sink with a bulk feed that missed part of the protocol (its `consumes`, its
    `counter_state_apart`) would be fed line by line: the same findings, silently slower."""
    bulk = [sink for sink in Analyzer().sinks if hasattr(sink, "feed_counter_block")]
    assert len(bulk) >= 4, bulk  # the plotted series, the probe record, probe health, memory growth
    assert [type(sink).__name__ for sink in bulk if not isinstance(sink, CounterBlockSink)] == []


@pytest.fixture(params=["one process", "two processes"])
def processes(request, monkeypatch):
    """The replay reads in the same process, or in a second one beside the detectors (as it does
    for large traces when a second core is there)."""
    monkeypatch.setattr(block_replay, "PARALLEL_MIN_BYTES", 1 << 62 if request.param == "one process" else 0)
    started: list[list[str]] = []
    popen = subprocess.Popen

    def recorded(command, *args, **kwargs):
        started.append(command)
        return popen(command, *args, **kwargs)

    monkeypatch.setattr(block_replay.subprocess, "Popen", recorded)
    yield request.param
    assert bool(started) == (request.param == "two processes"), started


def test_varied_trace_same_as_line_by_line(tmp_path, gathered_blocks, processes):
    path = str(tmp_path / "varied.kvtrace.json")
    write_trace(path, varied_events(30_000))
    result = assert_same(path)
    assert sum(gathered_blocks) > 20_000, "most counter lines went through the bulk path"
    kinds = {f["kind"] for f in result["report"]["findings"]}
    assert {schema.DOUBLE_FREE, schema.EVENTS_DROPPED, schema.MEMORY_GROWTH} <= kinds
    assert any(label.startswith("kv_slots:22:A#1") for label in result["series"])


@pytest.mark.parametrize("block_bytes", [1, 7, 150, 4096])
def test_block_boundaries_mid_line(tmp_path, monkeypatch, block_bytes):
    path = str(tmp_path / "small_blocks.kvtrace.json")
    write_trace(path, varied_events(2_000, seed=block_bytes))
    monkeypatch.setattr(blocks, "BLOCK_BYTES", block_bytes)
    assert_same(path)


def test_truncated_last_line(tmp_path):
    path = str(tmp_path / "cut.kvtrace.json")
    data = write_trace(path, varied_events(3_000, seed=3), finish=False)
    for cut in (len(data) - 1, len(data) - 40, len(data) - 97):
        with open(path, "wb") as fh:
            fh.write(data[:cut])
        result = assert_same(path)
        cut_inside_json = cut < len(data) - 2  # a line missing only its newline still reads whole
        assert cut_inside_json == any("mid-line" in note for note in result["report"]["notes"]), (cut, result["report"]["notes"])


def test_corrupt_lines_in_the_middle(tmp_path):
    path = str(tmp_path / "corrupt.kvtrace.json")
    lines = write_trace(path, varied_events(3_000, seed=4)).split(b"\n")
    counter = next(i for i, line in enumerate(lines) if b'"kv_slots"' in line and i > 100)
    lines[counter] = lines[counter][:-30]  # cut short: a counter line that is not JSON
    memory = next(i for i, line in enumerate(lines) if b'"memory"' in line and i > 200)
    at = lines[memory].index(b'"rss_bytes":') + 12
    lines[memory] = lines[memory][:at] + b"0" + lines[memory][at + 1 :]  # a leading zero, in a known shape: not JSON
    lines.insert(500, b"\x00garbage")
    with open(path, "wb") as fh:
        fh.write(b"\n".join(lines))
    result = assert_same(path)
    assert any("3 unreadable line(s)" in note for note in result["report"]["notes"]), result["report"]["notes"]
    assert result["report"]["findings"], "findings recorded around the damage are kept"


def test_oversized_line_is_skipped(tmp_path, monkeypatch):
    path = str(tmp_path / "long.kvtrace.json")
    lines = write_trace(path, varied_events(500, seed=5)).split(b"\n")
    lines.insert(100, b'{"ph":"C","name":"kv_slots","args":{"x":"' + b"y" * 5000 + b'"}},')
    with open(path, "wb") as fh:
        fh.write(b"\n".join(lines))
    monkeypatch.setattr("kvdoctor.trace.reader.MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(blocks, "MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(blocks, "BLOCK_BYTES", 1000)
    result = assert_same(path)
    assert any("longer than" in note for note in result["report"]["notes"])


def test_layout_refuses_what_it_cannot_vouch_for():
    good = b'{"ph":"C","name":"kv_slots","pid":4,"tid":1,"ts":17.5,"args":{"allocator":"A#0","free":10}},'
    layout = blocks.learn_layout(good)
    assert layout is not None and layout.name == "kv_slots" and good[layout.allocator] == b"A#0"
    assert layout.digits_ok()(good) and not layout.digits_ok()(good.replace(b'"free":10', b'"free":01'))
    for bad in (
        b'{"ph":"i","name":"kv_slots","pid":4,"ts":1,"args":{}}',  # not a counter
        b'{"ph":"C","name":"kv_slots","pid":4,"pid":5,"ts":1,"args":{}}',  # a repeated key
        b'{"ph":"C","name":"kv_slots","pid":4,"ts":1,"args":{"a1":1}}',  # a key with digits
        b'{"ph":"C","name":"kv_slots","pid":4,"ts":1e5,"args":{}}',  # an exponent
        b'{"ph":"C","name":"kv_slots","pid":4,"ts":1,"args":{"s":"a\\"b"}}',  # an escape
        b'{"ph":"C","name":"kv_slots","pid":4,"ts":1,"args":{"n":null}}',  # neither number nor string
        b'{"ph":"C", "name":"kv_slots","pid":4,"ts":1,"args":{}}',  # not compact
        b'{"ph":"C","name":"kv_slots","pid":4,"ts":1,"args":{"allocator":3}}',  # a numbered allocator
        b'{"ph":"C","name":"kv_slots","pid":1234567890123456789,"ts":1,"args":{}}',  # beyond 18 digits
    ):
        assert blocks.learn_layout(bad) is None, bad


def test_thinned_series_keeps_what_add_keeps():
    rng = random.Random(1)
    one_by_one: BoundedSeries[int] = BoundedSeries(7)
    in_runs: BoundedSeries[int] = BoundedSeries(7)
    in_slices: BoundedSeries[int] = BoundedSeries(7)
    index = 0
    for _ in range(200):
        run = rng.randrange(0, 40)
        for k in range(run):
            one_by_one.add(float(index + k), index + k)
        start = index
        in_runs.add_from(run, lambda ks, start=start: [(float(start + k), start + k) for k in ks])
        in_slices.extend([float(index + k) for k in range(run)], [index + k for k in range(run)])
        index += run
        expected = (one_by_one.times, one_by_one.values, one_by_one.stride)
        assert (in_runs.times, in_runs.values, in_runs.stride) == expected
        assert (in_slices.times, in_slices.values, in_slices.stride) == expected


def test_cli_replay_corrupt_header_is_one_line(tmp_path):
    path = tmp_path / "bad.kvtrace.json"
    path.write_bytes(b"[\n" + b'{"ph":"C","name":"kv_slots","pid":1,"ts":1,"args":{}},\n' * 3)
    proc = subprocess.run([sys.executable, "-m", "kvdoctor", "replay", str(path)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "header" in proc.stderr


DAMAGE = (
    "leading_zero",
    "leading_zero",
    "cut",
    "dup",
    "garbage",
    "swap",
    "newer_header",
    "carriage_return",
    "indent",
    "escape",
    "drop",
    "reserved_name",
)


def damage(lines: list[bytes], rng: random.Random) -> None:
    i = rng.randrange(1, len(lines))
    op = rng.choice(DAMAGE)
    if op == "leading_zero":  # "free_slots":123 -> "free_slots":023: the shape of a good line, but not JSON
        at = lines[i].find(b'free_slots":') + 12
        if at > 11 and lines[i][at : at + 2].isdigit():
            lines[i] = lines[i][:at] + b"0" + lines[i][at + 1 :]
    elif op == "cut":
        lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]
    elif op == "dup":
        lines.insert(i, lines[i])
    elif op == "garbage":
        lines.insert(i, bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 40))).replace(b"\n", b""))
    elif op == "swap":
        j = rng.randrange(1, len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == "newer_header":
        header = schema.header_event(pid=99, engine="sglang", engine_version="1", process_title="x")
        header.args["schema"] = "kvdoctor.trace/99"
        lines.insert(i, json.dumps(header.to_json_dict(), separators=(",", ":")).encode() + b",")
    elif op == "reserved_name":  # a counter line named like an event the reader or the analyzer reads itself
        name = rng.choice([schema.TRACE_END, schema.HEADER, schema.RUN_HEADER, schema.CENSUS, schema.PROCESS_NAME])
        line = b'{"ph":"C","name":"%s","pid":11,"tid":1,"ts":%d,"args":{"allocator":"A#0","free_slots":5}},' % (name.encode(), i)
        lines[i:i] = [line] * rng.randrange(1, 4)
    elif op == "carriage_return":
        lines[i] += b"\r"
    elif op == "indent":
        lines[i] = b"  " + lines[i]
    elif op == "escape":
        lines[i] = lines[i].replace(b'"A#0"', b'"A\\u00230"')  # the same allocator, written with an escape
    else:
        del lines[i]


@pytest.mark.parametrize("seed", range(30))
def test_damaged_traces_same_as_line_by_line(tmp_path, monkeypatch, seed):
    if seed % 5 == 0:
        monkeypatch.setattr(block_replay, "PARALLEL_MIN_BYTES", 0)  # some read by a second process
    """Damage of every kind, anywhere, at any block size: the same analysis, or the same one-line error."""
    rng = random.Random(seed)
    path = str(tmp_path / "damaged.kvtrace.json")
    lines = write_trace(path, varied_events(rng.randrange(50, 800), seed=seed), finish=rng.random() < 0.5).split(b"\n")
    for _ in range(rng.randrange(1, 8)):
        damage(lines, rng)
    data = b"\n".join(lines)
    if rng.random() < 0.3:
        data = data[: rng.randrange(len(data))]
    with open(path, "wb") as fh:
        fh.write(data)
    monkeypatch.setattr(blocks, "BLOCK_BYTES", rng.choice([1, 97, 4096, 1 << 20]))
    old, new = outcome(line_by_line, path), outcome(by_blocks, path)
    assert json.dumps(new) == json.dumps(old)


def test_sinks_without_bulk_feed_get_every_event_in_order(tmp_path):
    """A sink that takes events one at a time (the memory classes detector is one) sees every
    line of the names it reads, in trace order, interleaved with everything else it reads."""

    class Recorder:
        consumes = frozenset({schema.LEDGER_COUNTER, schema.VIOLATION, schema.MEMORY_CLASSES})

        def __init__(self) -> None:
            self.seen: list[tuple[str, int, float, str]] = []

        def feed(self, event: schema.Event) -> None:
            self.seen.append((event.name, event.pid, event.ts, json.dumps(event.args)))

        def findings(self) -> list:
            return []

    events = varied_events(5_000, seed=7)
    for i, event in enumerate(events[::50]):
        events.insert(
            i * 51, {"ph": "C", "name": schema.MEMORY_CLASSES, "pid": 11, "tid": 1, "ts": event.get("ts", 0), "args": {"anon_bytes": i}}
        )
    path = str(tmp_path / "ordered.kvtrace.json")
    write_trace(path, events)
    recorder = Recorder()
    analyzer = Analyzer(source=path, detectors=[recorder])
    block_replay.replay_blocks(path, AnalyzerTarget(analyzer), ReadStats())
    expected = [(e.name, e.pid, e.ts, json.dumps(e.args)) for e in iter_events(path) if e.name in Recorder.consumes]
    assert recorder.seen == expected
    assert {name for name, *_ in recorder.seen} == Recorder.consumes


def test_memory_stays_bounded_on_a_counters_only_trace(tmp_path, monkeypatch, gathered_blocks):
    """Counter lines are handed over at the end of every block read, never held longer."""
    path = str(tmp_path / "counters.kvtrace.json")
    events = [e for e in varied_events(20_000, seed=8) if e["ph"] == "C"]
    write_trace(path, events)
    monkeypatch.setattr(blocks, "BLOCK_BYTES", 64 * 1024)
    assert_same(path)
    longest = max(gathered_blocks)
    assert sum(gathered_blocks) > 15_000 and longest < 64 * 1024 // 100, longest


@pytest.fixture(scope="module")
def recorded_traces(tmp_path_factory):
    """Two real traces: `kvdoctor run` sampling the memory of a real `kvdoctor demo` (real SGLang
    allocator, radix tree and request pool, a planted double free), and the demo's own trace."""
    base = tmp_path_factory.mktemp("recorded")
    run_trace, demo_trace = str(base / "run.kvtrace.json"), str(base / "demo.kvtrace.json")
    env = {k: v for k, v in os.environ.items() if k != "KVDOCTOR_TRACE"}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    command = [sys.executable, "-m", "kvdoctor.cli", "demo", "--fault", "double-free", "--trace", demo_trace]
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "run", "--sample-interval", "0.02", "--trace", run_trace, "--", *command],
        cwd=str(base),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert os.path.exists(run_trace) and os.path.exists(demo_trace), proc.stdout[-2000:] + proc.stderr[-2000:]
    return run_trace, demo_trace


def test_recorded_traces_same_as_line_by_line(recorded_traces, gathered_blocks, monkeypatch, processes):
    run_trace, demo_trace = recorded_traces
    sampled = assert_same(run_trace)
    assert sum(gathered_blocks) > 100, "the sampler's memory lines went through the bulk path"
    assert len(sampled["series"]) >= 1
    probed = assert_same(demo_trace)
    assert schema.DOUBLE_FREE in {f["kind"] for f in probed["report"]["findings"]}
    monkeypatch.setattr(blocks, "BLOCK_BYTES", 333)  # blocks end mid-line everywhere
    assert_same(run_trace)
    assert_same(demo_trace)


def test_a_second_process_stopped_early_is_reaped(tmp_path, monkeypatch):
    """A trace refused half-way (a header from a newer kvdoctor) ends the reading process too."""
    path = str(tmp_path / "refused.kvtrace.json")
    lines = write_trace(path, varied_events(20_000, seed=9)).split(b"\n")
    header = schema.header_event(pid=99, engine="sglang", engine_version="1", process_title="x")
    header.args["schema"] = "kvdoctor.trace/99"
    lines.insert(200, json.dumps(header.to_json_dict(), separators=(",", ":")).encode() + b",")
    with open(path, "wb") as fh:
        fh.write(b"\n".join(lines))
    monkeypatch.setattr(block_replay, "PARALLEL_MIN_BYTES", 0)
    started: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def recorded(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(block_replay.subprocess, "Popen", recorded)
    with pytest.raises(KvdoctorError, match="newer kvdoctor"):
        analyze_trace(path)
    assert len(started) == 1 and started[0].returncode is not None


@pytest.mark.parametrize("name", [schema.TRACE_END, schema.HEADER, schema.RUN_HEADER, schema.CENSUS, schema.PROCESS_NAME])
def test_counter_lines_named_like_what_the_reader_reads(tmp_path, name):
    """A counter named like the end marker, a header, a census or a process name is read as
    the line-by-line reader reads it (the end is noted, the header checked, the census counted)."""
    path = str(tmp_path / "named.kvtrace.json")
    lines = write_trace(path, varied_events(300, seed=10), finish=False).split(b"\n")
    line = b'{"ph":"C","name":"%s","pid":11,"tid":1,"ts":5,"args":{"allocator":"A#0","free_slots":5}},' % name.encode()
    lines[50:50] = [line] * 3
    with open(path, "wb") as fh:
        fh.write(b"\n".join(lines))
    assert json.dumps(outcome(by_blocks, path)) == json.dumps(outcome(line_by_line, path))


def test_numbers_of_a_block_read_as_the_reader_reads_them():
    """A counter block's columns as floats are float() of what the reader parses: "-0" is 0.0
    (never -0.0), integers round to the nearest double, absent or text arguments are None."""
    lines = [
        b'{"ph":"C","name":"memory","pid":4,"tid":1,"ts":12345678901234567,"args":{"anon_bytes":-0,"title":"a"}},',
        b'{"ph":"C","name":"memory","pid":4,"tid":1,"ts":98765432109876543,"args":{"anon_bytes":-7,"title":"b"}},',
        b'{"ph":"C","name":"memory","pid":4,"tid":1,"ts":1.5,"args":{"anon_bytes":123456789012345678,"other":"x"}},',
        b'{"ph":"C","name":"memory","pid":4,"tid":1,"ts":2.25,"args":{"anon_bytes":"text","other":"y"}},',
    ]
    block = counter_block.CounterBlock("memory", 4, "")
    for line in lines:
        layout = blocks.learn_layout(line)
        assert layout is not None
        block.add_run(line + b"\n", layout)
    expected = [schema.Event.from_json_dict(json.loads(line[:-1])) for line in lines]
    assert block.timestamps() == [event.ts for event in expected]
    anon = block.floats_where_present("anon_bytes")
    assert anon == [0.0, -7.0, float(123456789012345678), None]
    assert math.copysign(1.0, anon[0]) == 1.0
    assert block.floats_where_present("title") is None and block.last_text("title") == "b"
