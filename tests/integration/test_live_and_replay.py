"""A live watch and a replay of its trace make the same findings.

One trace holds what every detector reads: a growing process seen by the sampler, the probe's
violations and censuses, host-growth attribution, retained views and a probe that turned a part of itself
off. It is fed both ways: event by event through the watch's own recorder (trace writer and
analyzer together), and through `analyze_trace`. Then a real `watch --attach` of a child process,
whose probe trace is stood in for, must report exactly what a replay of the trace it wrote does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvdoctor.analysis.findings import Finding
from kvdoctor.analysis.replay import analyze_trace
from kvdoctor.commands.watch import watch
from kvdoctor.runner import watch as watch_runner
from kvdoctor.runner.watch import WatchRecorder, watch_analyzer
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events
from kvdoctor.trace.writer import TraceWriter, finish_trace

MIB = 1024 * 1024
GIB = 1024 * MIB
LIMIT_BYTES = 64 * GIB
T0_S = 1_700_000_000.0
SERVER, DETOKENIZER = 11, 12


def _probe_events(pid: int, t_s: float) -> list[schema.Event]:
    """What the probe in one server process writes: violations, a census, attribution, health."""
    ts = t_s * 1e6

    def instant(name: str, **args: object) -> schema.Event:
        return schema.Event(ph="i", name=name, pid=pid, ts=ts, cat=schema.CAT_PROBE, args=dict(args))

    return [
        schema.header_event(pid=pid, engine="sglang", engine_version="0.5.23", process_title="sglang::scheduler"),
        instant(
            schema.VIOLATION,
            kind=schema.DOUBLE_FREE,
            allocator="TokenToKVPoolAllocator#0",
            site="free (s.py:1)",
            count=3,
            slot_ids=[5, 6, 7],
        ),
        instant(
            schema.VIOLATION, kind=schema.DOUBLE_FREE, allocator="TokenToKVPoolAllocator#0", site="free (s.py:1)", count=2, slot_ids=[8, 9]
        ),
        instant(
            schema.VIOLATION,
            kind=schema.STALE_LAST_LOC,
            allocator="TokenToKVPoolAllocator#0",
            site="alloc_extend (s.py:9)",
            count=1,
            slot_ids=[40],
        ),
        instant(
            schema.CENSUS,
            allocator="TokenToKVPoolAllocator#0",
            reason="exit",
            idle=True,
            orphan_slots=64,
            orphan_slot_ids=list(range(100, 164)),
            total_slots=2048,
            free_slots=1900,
            tree_slots=84,
        ),
        instant(
            schema.HOST_GROWTH_SITES,
            window_index=3,
            window_s=30,
            growth_bytes=96 * MIB,
            top_sites=[{"site": "cache.py:12", "size_diff_bytes": 80 * MIB, "thread": "storage-backup"}],
            by_thread=[{"thread": "storage-backup", "size_diff_bytes": 80 * MIB}],
        ),
        instant(
            schema.RETAINED_VIEWS,
            retained_bytes=512 * MIB,
            own_bytes=2 * MIB,
            long_lived_views=40,
            distinct_storages=12,
            storing_sites={"hiradix.py:88": 40},
        ),
        instant(schema.PROBE_STATUS, component="hicache", state="off", reason="an unknown HiCache layout"),
    ]


def _sampler_events() -> list[schema.Event]:
    """Ten minutes at 1 Hz: the scheduler leaks 10 GiB/h of anonymous memory, the detokenizer is flat."""
    events = [
        schema.header_event(
            pid=pid,
            engine="sglang",
            engine_version="",
            process_title=title,
            extra={"source": "sampler", "process_start_s": T0_S - 3600, "memory_limit_bytes": LIMIT_BYTES},
        )
        for pid, title in ((SERVER, "sglang::scheduler"), (DETOKENIZER, "sglang::detokenizer"))
    ]
    leak_bytes_per_s = 10 * GIB / 3600
    for k in range(600):
        anon = 2 * GIB + leak_bytes_per_s * k + (k % 7) * MIB
        for pid, args in (
            (SERVER, {"anon_bytes": int(anon), "rss_bytes": int(anon + GIB)}),
            (DETOKENIZER, {"anon_bytes": GIB, "rss_bytes": 2 * GIB}),
        ):
            events.append(schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=pid, ts=(T0_S + k) * 1e6, cat=schema.CAT_SAMPLER, args=args))
    return events


def _write(path: str, events: list[schema.Event]) -> None:
    writer = TraceWriter(path)
    writer.write_batch(events)
    writer.close()
    finish_trace(path, 1)


def _outcome(findings: list[Finding]) -> list[tuple[str, int, int]]:
    return sorted((f.kind, f.count, f.pid) for f in findings)


def test_the_watch_recorder_and_replay_find_the_same(tmp_path):
    run_header = schema.header_event(
        pid=1,
        engine="",
        engine_version="",
        process_title="kvdoctor watch 11",
        extra={"command": "watch", "root_pid": SERVER, "memory_limit_bytes": LIMIT_BYTES},
    )
    run_header.name = schema.RUN_HEADER
    source = str(tmp_path / "source.kvtrace.json")
    _write(source, [run_header, *_sampler_events(), *_probe_events(SERVER, T0_S + 600)])

    recorded = str(tmp_path / "watch.kvtrace.json")
    writer = TraceWriter(recorded)
    analyzer = watch_analyzer(host_memory_limit_bytes=LIMIT_BYTES)
    recorder = WatchRecorder(writer, analyzer, None, None, None, findings_every_s=5.0)
    for event in iter_events(source):
        recorder.record([event])  # one event at a time, as the sampler's rounds arrive
    writer.close()
    finish_trace(recorded, 1)
    live = _outcome(analyzer.finish().findings)

    assert live == _outcome(analyze_trace(source, host_memory_limit_bytes=LIMIT_BYTES).findings)
    assert live == _outcome(analyze_trace(recorded, host_memory_limit_bytes=LIMIT_BYTES).findings)
    kinds = {kind for kind, _, _ in live}
    assert {
        schema.MEMORY_GROWTH,
        schema.DOUBLE_FREE,
        schema.STALE_LAST_LOC,
        schema.ORPHAN_SLOTS,
        schema.HOST_GROWTH,
        schema.RETAINED_VIEW,
        schema.PROBE_PARTIAL,  # the HiCache ledger turned off, the slot ledger went on
    } <= kinds, live
    assert (schema.DOUBLE_FREE, 5, SERVER) in live and (schema.ORPHAN_SLOTS, 64, SERVER) in live
    assert [pid for kind, _, pid in live if kind == schema.MEMORY_GROWTH] == [SERVER]


@pytest.fixture
def child():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(3)"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def test_watch_with_the_probe_reports_what_replay_of_its_trace_does(child, tmp_path, capsys, monkeypatch):
    probe_trace = str(tmp_path / "probe.kvtrace.json")
    _write(probe_trace, _probe_events(child.pid, T0_S))
    monkeypatch.setattr(watch_runner, "attach_for_watch", lambda pid, path, **_: probe_trace)
    trace = str(tmp_path / "w.kvtrace.json")
    code = watch(child.pid, interval_s=0.2, duration_s=10, trace_path=trace, output_format="json", attach=True)
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "kvdoctor.watch/1"
    assert code == 1  # the probe's double frees and orphans are errors, in a watch as in a replay
    live = sorted((f["kind"], f["count"], f["pid"]) for f in report["findings"])
    assert live == _outcome(analyze_trace(trace).findings)
    assert {schema.DOUBLE_FREE, schema.ORPHAN_SLOTS, schema.HOST_GROWTH, schema.PROBE_PARTIAL} <= {k for k, _, _ in live}
    # the probe's events sit in the watch's trace beside the sampler's, its end marker excluded
    names = [e.name for e in iter_events(trace)]
    assert names.count(schema.VIOLATION) == 3 and names.count(schema.TRACE_END) == 1
