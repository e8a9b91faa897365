"""`kvdoctor run --metrics`: the probed processes' ledgers as Prometheus metrics, served by the run
and fed from the trace the probes write; the shipped alert rules checked and run by Debian's real
`promtool`. (A real SGLang server under `--metrics` scraped by a real Prometheus, its alert listed
by a real Alertmanager: tests/e2e/test_sglang_server.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO, SUPPORT, trace_events

sys.path.insert(0, SUPPORT)

import prometheus_stack
from servers import free_port

parser = pytest.importorskip("prometheus_client.parser")

from kvdoctor.formats.live import fleet  # noqa: E402
from kvdoctor.trace import schema  # noqa: E402

PROMTOOL_MISSING = "" if os.access(prometheus_stack.PROMTOOL, os.X_OK) else f"{prometheus_stack.PROMTOOL} is missing: run .ci/setup-tests"
needs_promtool = pytest.mark.skipif(bool(PROMTOOL_MISSING), reason=PROMTOOL_MISSING or "ok")

# Two of SGLang's real allocators and radix trees, one after the other in one process: a leak planted
# in the first, a double free in the second; then it waits for the test to have read the metrics.
WORKLOAD = """
import json, os, sys, time
from kvdoctor.demo.workload import WorkloadConfig, run_workload
leak = run_workload(WorkloadConfig(conversations=8, turns=2, fault="leak", fault_at_request=3))
double_free = run_workload(WorkloadConfig(conversations=8, turns=2, fault="double-free", fault_at_request=3))
print(json.dumps({"leak": leak.planted, "double_free": double_free.planted}), flush=True)
deadline = time.monotonic() + 240
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
"""


def _kvdoctor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVDOCTOR_TRACE"}
    return subprocess.run([sys.executable, "-m", "kvdoctor.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    families: dict[str, list] = {}
    for family in parser.text_string_to_metric_families(text):
        families.setdefault(family.name, []).extend(family.samples)
    return families


@needs_promtool
def test_promtool_checks_the_shipped_rules():
    proc = subprocess.run([prometheus_stack.PROMTOOL, "check", "rules", prometheus_stack.RULES], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "SUCCESS: 6 rules found" in proc.stdout, proc.stdout + proc.stderr


@needs_promtool
def test_the_shipped_rules_fire_on_their_cases_in_promtool():
    """Orphans at one census are no alert, at two in a row they are; a double free alerts, an
    orphan named at a release does not; a probe off alerts, a partial one not; 1 MiB/s with 9 GiB
    left alerts once sustained 30 minutes, a flat process never; the docs' query names the one
    drifting rank of four (tests/support/fleet_rules_test.yml)."""
    cases = os.path.join(SUPPORT, "fleet_rules_test.yml")
    proc = subprocess.run([prometheus_stack.PROMTOOL, "test", "rules", cases], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
    # docs/fleet.md's drifting-rank query is the one promtool ran there (of four ranks, it names tp2)
    with open(os.path.join(REPO, "docs", "fleet.md")) as fh:
        query = fh.read().split("```promql\n", 1)[1].split("```", 1)[0]
    with open(cases) as fh:
        assert " ".join(query.split()) in " ".join(fh.read().split())


@pytest.fixture(scope="module")
def metrics_run(tmp_path_factory) -> dict:
    """Real SGLang allocators under `kvdoctor run --metrics` (WORKLOAD), scraped while the run goes
    on: once the leak's census and the double free reached /metrics, the scrape and the trace."""
    workdir = tmp_path_factory.mktemp("fleet")
    trace = str(workdir / "fleet.kvtrace.json")
    done = str(workdir / "done")
    port = free_port()
    command = [sys.executable, "-m", "kvdoctor.cli", "run", "--metrics", f"127.0.0.1:{port}", "--sample-interval", "0.2", "--trace", trace]
    env = {k: v for k, v in os.environ.items() if k != "KVDOCTOR_TRACE"}
    proc = subprocess.Popen(
        [*command, "--", sys.executable, "-c", WORKLOAD, done], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    try:
        assert proc.stdout is not None
        planted = json.loads(proc.stdout.readline())
        pid = next(e["pid"] for e in trace_events(trace, schema.HEADER) if e.get("cat") == schema.CAT_PROBE)
        deadline = time.monotonic() + 60
        while True:
            families = _scrape(f"http://127.0.0.1:{port}/metrics")
            orphans = {s.labels["pool"]: s.value for s in families.get("kvdoctor_census_orphan_slots", [])}
            kinds = {s.labels["kind"] for s in families.get("kvdoctor_violations", [])}
            if (orphans and max(orphans.values()) > 0 and "double_free" in kinds) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    finally:
        open(done, "w").close()
        out, err = proc.communicate(timeout=120)
    return {"families": families, "trace": trace, "planted": planted, "pid": pid, "port": port, "returncode": proc.returncode, "err": err}


def _planted_pools(trace: str) -> tuple[str, str]:
    """(the leaked pool, the pool freed twice), as the trace names them."""
    (leaked,) = {e["args"]["allocator"] for e in trace_events(trace, schema.CENSUS) if e["args"]["orphan_slots"] > 0}
    (freed_twice,) = {e["args"]["allocator"] for e in trace_events(trace, schema.VIOLATION) if e["args"].get("kind") == "double_free"}
    return leaked, freed_twice


def test_run_serves_the_ledgers_of_sglangs_own_pools(metrics_run):
    """The planted leak's orphans, the planted double free, the labels, memory and probe health, as
    a scrape reads them while the run goes on; the run's own exit and first lines stay as they were."""
    families, trace, planted, pid = metrics_run["families"], metrics_run["trace"], metrics_run["planted"], metrics_run["pid"]
    assert metrics_run["returncode"] == 0, metrics_run["err"][-3000:]
    port = metrics_run["port"]
    assert metrics_run["err"].splitlines()[1] == f"kvdoctor: metrics on http://127.0.0.1:{port}/metrics", metrics_run["err"][:2000]
    leaked_pool, pool = _planted_pools(trace)
    orphans = {s.labels["pool"]: s.value for s in families["kvdoctor_census_orphan_slots"]}
    assert orphans.get(leaked_pool) == planted["leak"]["orphan_slots"] > 0, (orphans, planted)
    violations = {(s.labels["pool"], s.labels["kind"]): s.value for s in families["kvdoctor_violations"] if s.name.endswith("_total")}
    freed_twice = [e for e in trace_events(trace, schema.VIOLATION) if e["args"].get("kind") == "double_free"]
    assert violations[(pool, "double_free")] == len(freed_twice) >= 1, violations
    slots = {s.labels["pool"] for s in families["kvdoctor_kv_slots"]}
    assert pool != leaked_pool and {pool, leaked_pool} <= slots  # the two engines' pools apart
    (health,) = [s for s in families["kvdoctor_probe_health"] if s.value == 1]
    assert health.labels["health"] == "on" and health.labels["engine"] == "sglang" and health.labels["pid"] == str(pid)
    assert health.labels["version"] and "python -c" in health.labels["title"]
    classes = {s.labels["class"] for s in families["kvdoctor_memory_bytes"] if s.labels["pid"] == str(pid)}
    assert {"rss", "anon", "malloc_heap"} <= classes, classes
    assert families["kvdoctor_census_age_seconds"] and all(s.value >= 0 for s in families["kvdoctor_census_age_seconds"])
    series = sum(len(samples) for samples in families.values())
    assert 0 < series <= fleet.SERIES_BOUND
    print(f"metric families {len(families)}, series {series}")


def test_attach_serves_the_probes_trace_until_the_process_exits(metrics_run):
    """`attach --metrics`'s part after the attach: the probe's trace served while the process lives,
    the server gone once it exits."""
    import threading

    from kvdoctor.commands.attach import serve_until_gone
    from kvdoctor.formats.live.fleet_server import FleetExporter

    leaked_pool, _ = _planted_pools(metrics_run["trace"])
    orphans = metrics_run["planted"]["leak"]["orphan_slots"]
    target = subprocess.Popen(["sleep", "120"])
    port = free_port()
    server = threading.Thread(target=serve_until_gone, args=(FleetExporter(f"127.0.0.1:{port}", metrics_run["trace"]), target.pid))
    server.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                served = {
                    s.labels["pool"]: s.value for s in _scrape(f"http://127.0.0.1:{port}/metrics").get("kvdoctor_census_orphan_slots", [])
                }
            except OSError:
                served = {}
            if served.get(leaked_pool) == orphans or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert served.get(leaked_pool) == orphans, served
    finally:
        target.kill()
        target.wait()
    server.join(timeout=10)
    assert not server.is_alive()
    with pytest.raises(OSError):
        _scrape(f"http://127.0.0.1:{port}/metrics")


def test_findings_as_json_lines_carry_the_metrics_labels(metrics_run, tmp_path):
    """`replay --format jsonl`: one JSON object a finding, labelled as the series are."""
    out = tmp_path / "findings.jsonl"
    proc = _kvdoctor("replay", metrics_run["trace"], "--format", "jsonl", "-o", str(out))
    assert proc.returncode == 1, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    leaked_pool, pool = _planted_pools(metrics_run["trace"])
    (leak,) = [r for r in records if r["kind"] == "orphan_slots"]
    assert leak["pool"] == leaked_pool and leak["count"] == metrics_run["planted"]["leak"]["orphan_slots"]
    assert leak["engine"] == "sglang" and leak["version"] and leak["pid"] == metrics_run["pid"] and leak["schema"] == "kvdoctor.finding/1"
    (double,) = [r for r in records if r["kind"] == "double_free"]
    assert double["pool"] == pool and double["severity"] == "error"
    assert all({"engine", "version", "pid", "title", "rank", "pool", "message", "evidence"} <= set(r) for r in records)


@pytest.mark.parametrize(
    "address, said",
    [
        ("10.1.2.3:9400", "--metrics 10.1.2.3 is not a loopback address; the metrics would be open to the network"),
        ("127.0.0.1:x", "--metrics needs a port, not '127.0.0.1:x'"),
        ("127.0.0.1:70000", "--metrics port 70000 is out of range"),
    ],
)
def test_a_bad_metrics_address_is_one_line_before_anything_runs(tmp_path, address, said):
    marker = tmp_path / "ran"
    proc = _kvdoctor("run", "--metrics", address, "--trace", str(tmp_path / "t.json"), "--", "touch", str(marker))
    assert proc.returncode == 2 and proc.stderr.count("\n") <= 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()


def test_attach_refuses_a_public_metrics_address_before_it_attaches(tmp_path):
    target = subprocess.Popen(["sleep", "60"])
    try:
        proc = _kvdoctor("attach", str(target.pid), "--metrics", "10.1.2.3:9400", "--trace", str(tmp_path / "t.json"))
    finally:
        target.kill()
        target.wait()
    assert proc.returncode == 2 and "--metrics 10.1.2.3 is not a loopback address" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "t.json").exists(), proc.stderr  # nothing went in


def test_a_metrics_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _kvdoctor("run", "--metrics", f"127.0.0.1:{port}", "--trace", str(tmp_path / "t.json"), "--", "true")
    assert proc.returncode == 2 and f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr, (
        proc.stderr
    )


def _event(name: str, pid: int, args: dict, ts: float = 1e15, cat: str = schema.CAT_PROBE) -> schema.Event:
    return schema.Event.from_json_dict({"ph": "i", "name": name, "pid": pid, "tid": 0, "ts": ts, "cat": cat, "args": args})


def test_orphan_streak_and_health_follow_the_trace():
    state = fleet.FleetState(clock=lambda: 1e9 + 7)
    census = {"allocator": "tp1/TokenToKVPoolAllocator#0"}
    state.feed(
        [
            _event(
                schema.HEADER,
                5,
                {"engine": "sglang", "engine_version": "0.5.23", "process_title": "sglang::scheduler_TP1 --api-key=s3cret"},
            ),
            *[_event(schema.CENSUS, 5, {**census, "orphan_slots": n}, ts=1e15 + i) for i, n in enumerate([0, 3, 3])],
            _event(schema.PROBE_STATUS, 5, {"component": "memory_classes", "state": "off"}),
            _event(schema.VIOLATION, 5, {**census, "kind": "made_up", "count": 4}),
        ]
    )
    rows = {name: samples for name, _, _, samples in state.families()}
    ((labels, streak),) = rows["kvdoctor_census_orphan_streak"]
    assert streak == 2 and labels["rank"] == "tp1" and labels["pool"] == "TokenToKVPoolAllocator#0"
    assert "s3cret" not in labels["title"] and labels["title"].startswith("sglang::scheduler_TP1")
    assert rows["kvdoctor_census_age_seconds"][0][1] == pytest.approx(7.0, abs=1e-3)
    assert [(lab["health"], v) for lab, v in rows["kvdoctor_probe_health"]] == [("on", 0.0), ("partial", 1.0), ("off", 0.0)]
    assert [lab["part"] for lab, _ in rows["kvdoctor_probe_part_stopped"]] == ["memory_classes"]
    assert [(lab["kind"], v) for lab, v in rows["kvdoctor_violation_slots"]] == [("other", 4.0)]
    state.feed(
        [_event(schema.CENSUS, 5, {**census, "orphan_slots": 0}), _event(schema.PROBE_STATUS, 5, {"component": "ledger", "state": "off"})]
    )
    rows = {name: samples for name, _, _, samples in state.families()}
    assert rows["kvdoctor_census_orphan_streak"][0][1] == 0
    assert [lab["health"] for lab, v in rows["kvdoctor_probe_health"] if v == 1] == ["off"]


def test_cardinality_stays_within_its_bound():
    """Far more processes, pools, parts and fields than the bounds: the first ones are kept, the
    rest counted, and a scrape never holds more than SERIES_BOUND series."""
    events = []
    for pid in range(1, 200):
        events.append(_event(schema.HEADER, pid, {"engine": "sglang", "engine_version": "0.5.23", "process_title": "x" * 5000}))
        for pool in range(40):
            allocator = f"tp{pid}/Pool#{pool}"
            events.append(_event(schema.CENSUS, pid, {"allocator": allocator, "orphan_slots": 1}))
            events.append(_event(schema.VIOLATION, pid, {"allocator": allocator, "kind": f"kind{pool}", "count": 1}))
        for part in range(40):
            events.append(_event(schema.PROBE_STATUS, pid, {"component": f"part{part}", "state": "off"}))
        events.append(_event(schema.HICACHE_COUNTER, pid, {f"field{i}": i for i in range(100)}))
    state = fleet.FleetState()
    state.feed(events)
    rows = {name: samples for name, _, _, samples in state.families()}
    assert len({lab["pid"] for lab, _ in rows["kvdoctor_probe_health"]}) == fleet.MAX_PROCESSES
    assert rows["kvdoctor_metrics_processes_left_out"] == [({}, 199.0 - fleet.MAX_PROCESSES)]
    assert max(len(lab["title"]) for lab, _ in rows["kvdoctor_probe_health"]) <= fleet.TITLE_LIMIT
    assert len(rows["kvdoctor_census_orphan_slots"]) == fleet.MAX_PROCESSES * fleet.MAX_POOLS
    assert {lab["kind"] for lab, _ in rows["kvdoctor_violations"]} == {"other"}
    assert sum(len(samples) for samples in rows.values()) <= fleet.SERIES_BOUND
