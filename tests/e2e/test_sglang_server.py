"""A real SGLang 0.5.23 server on this CPU (`python -m sglang.launch_server --device cpu`, a tiny local
model) under `kvdoctor run`, driven by SGLang's own `bench_serving` and by multi-turn chats with
shared prefixes, abandoned requests and long prompts, stopped with SIGINT, its trace judged.

Clean runs in configurations other than the default give no error finding (SGLang's own strict
idle check stays on there: it would end the scheduler at a real leak). Faults planted in the scheduler
(`tests/support/sglang_fault`) are counted exactly, a leak is named within seconds while the load
goes on. A probe put into a server that has served a while (its tree full, evicting) proves what
it adopted before it judges, and names leaks from before and after it came apart, exactly.

The clean, leak and planted-fault servers run under `--metrics` too, scraped by Debian's real
Prometheus with kvdoctor's shipped rules beside a real Alertmanager (tests/support/prometheus_stack.py):
no alert for the clean ones, the orphan and memory-safety alerts listed for the others.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
from conftest import SUPPORT

sys.path.insert(0, SUPPORT)

import prometheus_stack
import sglang_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("needs_sglang_server")]


def _events(trace: str) -> list[dict]:
    with open(trace) as fh:
        return [json.loads(line.rstrip().rstrip(",")) for line in fh if line.startswith("{")]


def _errors(report: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for finding in report["findings"]:
        if finding["severity"] == "error":
            out[finding["kind"]] = out.get(finding["kind"], 0) + finding["count"]
    return out


def _alerting(tmp_path, server: sglang_server.Server) -> prometheus_stack.Stack | None:
    """Debian's real Prometheus and Alertmanager with kvdoctor's shipped rules, scraping the
    server's `kvdoctor run --metrics` every second; None (the metrics part of the test left out)
    where the binaries are missing."""
    if prometheus_stack.available():
        return None
    workdir = tmp_path / "prometheus"
    workdir.mkdir()
    return prometheus_stack.Stack(str(workdir), server.metrics_address).start()


def _listed(stack: prometheus_stack.Stack, alertname: str, timeout_s: float) -> tuple[list[dict], float]:
    """Alertmanager's alerts named `alertname` once it lists one, and when (time.time())."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [a for a in stack.alertmanager_alerts() if a["labels"].get("alertname") == alertname]
        if found:
            return found, time.time()
        time.sleep(0.2)
    raise AssertionError(f"Alertmanager listed no {alertname} in {timeout_s:.0f} s: {stack.alertmanager_alerts()}")


def _none_fire_once_judged(stack: prometheus_stack.Stack) -> None:
    """A clean run under the shipped rules: once Prometheus holds two censuses of every pool, and
    every rule was evaluated after, no alert is firing or pending, and Alertmanager lists none."""
    deadline = time.monotonic() + 60
    while not (stack.query("kvdoctor_censuses_total >= 2") and stack.query("kvdoctor_census_orphan_slots == 0")):
        assert time.monotonic() < deadline, "Prometheus never scraped two censuses"
        time.sleep(0.5)
    judged_at = stack.server_time()
    while not stack.evaluated_after(judged_at):
        assert time.monotonic() < deadline, "the rules were not evaluated"
        time.sleep(0.2)
    assert stack.query("kvdoctor_censuses_total < 2") == []  # every pool counted twice
    alerts = prometheus_stack._get(stack.prometheus_url + "/api/v1/alerts")["data"]["alerts"]
    assert alerts == [] and stack.alertmanager_alerts() == [], alerts


def _drive(server: sglang_server.Server) -> None:
    chats = server.conversations(turns=2, users=4)
    assert chats["ok"] >= 6 and chats["errors"] == 0, chats
    bench = server.bench_serving(prompts=24)
    assert bench.returncode == 0 and "Successful requests:                     24" in bench.stdout, bench.stderr[-2000:]


# The default configuration (radix cache, page 1) runs clean in tests/e2e/test_readme_gate.py (the
# docs' CI gate on a real benchmark, judged on its shutdown census, the hooks counted there too) and
# under load in the tests below, which count every finding exactly: it is not started a third time.
ALERT_BOUND_S = 30 * prometheus_stack.SCRAPE_INTERVAL_S  # from the census that makes an alert to Alertmanager listing it


def _check_the_orphan_alert(stack, server, named, planted, alerts, listed_at) -> None:
    """The alert names the scheduler's pool with the planted count; no other alert fires; the
    dashboard's queries and the docs' drifting-rank query run on what was scraped."""
    scheduler = named["pid"]
    (alert,) = [a for a in alerts if a["labels"]["pid"] == str(scheduler)]
    labels = alert["labels"]
    assert labels["pool"] == "TokenToKVPoolAllocator#0" and labels["engine"] == "sglang" and labels["version"] == "0.5.23", labels
    assert alert["annotations"]["summary"].startswith(
        f"{planted['count']} KV slot(s) leaked in TokenToKVPoolAllocator#0 of pid {scheduler}"
    )
    counted = [e for e in _events(server.trace) if e["name"] == "census" and e["pid"] == scheduler and e["args"]["orphan_slots"] > 0]
    second_census_s = counted[1]["ts"] / 1e6
    print(f"scrape-to-alert: Alertmanager listed the orphan alert {listed_at - second_census_s:.1f} s after the second census")
    assert listed_at - second_census_s <= ALERT_BOUND_S
    assert {a["labels"]["alertname"] for a in stack.alertmanager_alerts()} == {"KvdoctorOrphanSlots"}
    with open(prometheus_stack.DASHBOARD) as fh:
        exprs = [t["expr"] for panel in json.load(fh)["panels"] for t in panel["targets"]]
    drifting = _docs_drifting_rank()
    for expr in [*exprs, drifting]:
        stack.query(expr)  # each parses and runs on Prometheus itself
    assert stack.query(drifting) == []  # one rank: none drifts from its own median
    series = stack.query('count({__name__=~"kvdoctor_.+", job="kvdoctor"})')
    print(f"series scraped from the run: {series[0]['value'][1]}")


def _docs_drifting_rank() -> str:
    """The PromQL of docs/fleet.md that names the rank whose ledger drifts."""
    with open(os.path.join(os.path.dirname(SUPPORT), "..", "docs", "fleet.md")) as fh:
        text = fh.read()
    return text.split("```promql\n", 1)[1].split("```", 1)[0].strip()


CONFIGS = {
    "page 16, chunked prefill 64, fcfs": ["--page-size", "16", "--chunked-prefill-size", "64", "--schedule-policy", "fcfs"],
    "no radix cache, page 16, no overlap, lof": [
        "--disable-radix-cache",
        "--page-size",
        "16",
        "--disable-overlap-schedule",
        "--schedule-policy",
        "lof",
    ],
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_clean_server_has_no_error_finding(tmp_path, config):
    """Also served under `--metrics` to a real Prometheus with the shipped rules: no alert fires."""
    server = sglang_server.Server(str(tmp_path), flags=CONFIGS[config], metrics=True)
    stack = _alerting(tmp_path, server)
    try:
        server.start()
        _drive(server)
        if stack is not None:
            _none_fire_once_judged(stack)
    finally:
        code = server.stop()
        if stack is not None:
            stack.stop()
    assert code in (0, 130), server.log_tail()
    events = _events(server.trace)
    hooked = [e["args"]["reason"] for e in events if e["name"] == "probe_status" and "methods hooked" in e["args"].get("reason", "")]
    counts = [int(reason.split(": ")[-1].split()[0]) for reason in hooked]
    assert counts and max(counts) == 73, hooked[-3:]  # every hook of the map a server meets, in the scheduler
    censuses = [e["args"] for e in events if e["name"] == "census"]
    assert censuses and censuses[-1]["ledger_disagrees_slots"] == 0  # the ledger agrees with SGLang's own free list
    _served_once_after_its_ledger(events)
    rc, report = sglang_server.replay(server.trace)
    assert rc == 0 and _errors(report) == {}, report["findings"][:3]


def _served_once_after_its_ledger(events: list[dict]) -> None:
    """The scheduler says it is starting, then once, after its ledger exists, that it took its first
    request: the end of its start-up for the memory growth tests."""
    (ledger,) = [e for e in events if e["name"] == "probe_status" and str(e["args"].get("reason", "")).startswith("ledger for ")][:1]
    scheduler = ledger["pid"]
    marks = [e for e in events if e["name"] == "probe_status" and e["args"].get("component") == "serving" and e["pid"] == scheduler]
    assert [m["args"]["state"] for m in marks] == ["starting", "on"], marks
    assert marks[0]["ts"] <= ledger["ts"] <= marks[1]["ts"], marks


def test_a_leak_is_named_within_seconds_while_the_load_goes_on(tmp_path):
    """Served under `--metrics` to a real Prometheus with the shipped rules and a real Alertmanager
    too: the orphan alert is listed by Alertmanager within a bounded number of scrape intervals of
    the second census that counted the leak, with the pool, engine and count."""
    server = sglang_server.Server(str(tmp_path), flags=["--disable-radix-cache"], fault="leak", fault_at=20, metrics=True)
    stack = _alerting(tmp_path, server)
    try:
        server.start()
    except BaseException:
        if stack is not None:
            stack.stop()
        raise
    stop_load = threading.Event()

    def load() -> None:
        while not stop_load.is_set():
            server.conversations(turns=2, users=3, abort_every=0)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        deadline = time.monotonic() + 180
        named = None
        while named is None and time.monotonic() < deadline:
            time.sleep(0.5)
            planted = (server.fault() or {}).get("leak")
            if planted and os.path.exists(server.trace):
                named = next(
                    (e for e in _events(server.trace) if e["name"] == "violation" and e["args"].get("kind") == "orphan_slots"), None
                )
        assert planted and named, "the planted leak was not named"
        delay_s = named["ts"] / 1e6 - planted["time_s"]
        assert delay_s < 10.0 and loader.is_alive(), f"named {delay_s:.1f} s after the drop"
        if stack is not None:
            alerts, listed_at = _listed(stack, "KvdoctorOrphanSlots", ALERT_BOUND_S)
            _check_the_orphan_alert(stack, server, named, planted, alerts, listed_at)
    finally:
        stop_load.set()
        loader.join(timeout=300)
        server.stop()
        if stack is not None:
            stack.stop()
    assert named["args"]["count"] == planted["count"]
    assert named["args"]["slot_ids"] == planted["slot_ids"][:64]
    rc, report = sglang_server.replay(server.trace)
    assert rc == 1 and _errors(report) == {"orphan_slots": planted["count"]}, report["findings"][:3]


def test_planted_double_free_stale_last_loc_and_index_out_of_range_are_counted_exactly(tmp_path):
    """Under `--metrics` too: Alertmanager lists the memory-safety alert of each kind planted."""
    faults = "double-free,stale-last-loc,index-out-of-range"
    flags = ["--page-size", "16", "--disable-radix-cache"]
    server = sglang_server.Server(str(tmp_path), flags=flags, fault=faults, fault_at=20, metrics=True)
    stack = _alerting(tmp_path, server)
    try:
        server.start()
        _drive(server)
        if stack is not None:
            deadline = time.monotonic() + ALERT_BOUND_S
            kinds: set[str] = set()
            while kinds != {"double_free", "stale_last_loc", "index_out_of_range"} and time.monotonic() < deadline:
                alerts, _ = _listed(stack, "KvdoctorMemorySafetyViolation", ALERT_BOUND_S)
                kinds = {a["labels"]["kind"] for a in alerts}
            assert kinds == {"double_free", "stale_last_loc", "index_out_of_range"}, kinds
            assert {a["labels"]["alertname"] for a in stack.alertmanager_alerts()} == {"KvdoctorMemorySafetyViolation"}
    finally:
        server.stop()
        if stack is not None:
            stack.stop()
    planted = server.fault() or {}
    assert set(planted) == set(faults.split(",")), planted
    rc, report = sglang_server.replay(server.trace)
    assert rc == 1
    assert _errors(report) == {"double_free": planted["double-free"]["count"], "stale_last_loc": 1, "index_out_of_range": 2}
    oor = next(f for f in report["findings"] if f["kind"] == "index_out_of_range")
    assert -5 in {oor["evidence"].get("bad_index")} | set(oor["evidence"].get("slot_ids") or [])
    double = next(f for f in report["findings"] if f["kind"] == "double_free")
    page = planted["double-free"]["page_size"]  # a freed page is named by all its slots, a request may fill it partly
    assert {s // page for s in double["evidence"]["slot_ids"]} <= {s // page for s in planted["double-free"]["slot_ids"]}
    # the flight recorder: each page the double free names was handed out, then freed twice, the second
    # free the one that broke the books; the stale last_loc's page ends with the read of it
    rid = planted["double-free"]["rid"]  # the request whose free ran twice
    for history in double["evidence"]["history"]:
        ops = [e["op"] for e in history["entries"]]
        assert ops[-2:] == ["free", "free"] and "alloc" in ops[:-2], ops
        assert all(e["site"] for e in history["entries"][-2:]), history
        # each free names the row it came from and the request that row served then
        assert rid and [e.get("rid") for e in history["entries"][-2:]] == [rid, rid], (rid, history)
    stale = next(f for f in report["findings"] if f["kind"] == "stale_last_loc")
    assert [e["op"] for e in stale["evidence"]["history"][0]["entries"]][-1] == "last_loc", stale["evidence"]["history"]


def _serve_then_attach(tmp_path, flags: list[str], fault: str = "", fault_at: str = "0", watch=None) -> tuple[sglang_server.Server, str]:
    """A server started without kvdoctor serves until its radix tree holds most of the pool (and
    evicts), the probe goes in with the code `kvdoctor attach` injects (gdb itself cannot call into
    processes on this machine: see test_attach), a second load must evict what the tree holds,
    and the server stops once the probe took its idle census. `watch(server)`: the attach is made by
    it (a `watch --attach` of the scheduler), and its trace path comes back."""
    server = sglang_server.Server(
        str(tmp_path), probe=False, flags=flags, fault=fault, fault_at=fault_at, attach_on_signal=True, max_total_tokens=4096
    ).start()
    trace = str(tmp_path / "attached.kvtrace.json")
    try:
        before = server.bench_serving(prompts=60)  # 60 prompts of 120 tokens: more than the pool holds
        assert before.returncode == 0, before.stderr[-2000:]
        if watch is not None:
            trace = watch(server)
        else:
            status = server.attach_now(trace)
            assert status.get("ok"), status
        after = server.bench_serving(prompts=30)
        assert after.returncode == 0, after.stderr[-2000:]
        since_us = time.time() * 1e6  # one last request: the idle census after it counts every request before
        server.generate(list(range(5, 21)), 4)
        _wait_for_idle_census(trace, since_us)
    finally:
        server.stop()
    return server, trace


def _wait_for_idle_census(trace: str, since_us: float, timeout_s: float = 60.0) -> None:
    """The probe counts the pool once the engine has been quiet a moment: a server attached by
    hand is stopped with no word to the probe, so the test waits for that census."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e["name"] == "census" and e["args"].get("idle") and e["ts"] >= since_us for e in _events(trace)):
            return
        time.sleep(0.5)
    raise AssertionError("no idle census after the load")


def _adoption(trace: str) -> dict:
    (adopted,) = [e["args"] for e in _events(trace) if e["name"] == "probe_status" and e["args"].get("adopted")]
    return adopted


def test_a_clean_server_attached_once_its_tree_filled_has_no_error_finding(tmp_path):
    """Radix cache on, chunked prefill, page size 1: the adoption reads a tree holding most of the
    pool, its books agree with SGLang's own counters, and nothing is named."""
    server, trace = _serve_then_attach(tmp_path, ["--chunked-prefill-size", "64"])
    adopted = _adoption(trace)
    assert adopted["verified"], adopted["books"]
    assert adopted["tree_slots"] > 4096 // 2 and adopted["held_by_no_one_slots"] == 0, adopted
    rc, report = sglang_server.replay(trace)
    assert _errors(report) == {} and rc == 0, report["findings"][:3]


class _WatchAttached:
    """`kvdoctor watch <scheduler> --attach`, in a thread of this process, its attach made with the
    code `kvdoctor attach` injects (the test's signal carries it in place of gdb)."""

    def __init__(self, tmp_path, monkeypatch) -> None:
        self.path = str(tmp_path / "watch.kvtrace.json")
        self.monkeypatch = monkeypatch
        self.result = None
        self.thread = None

    def __call__(self, server: sglang_server.Server) -> str:
        from kvdoctor.delivery import attach as attach_module
        from kvdoctor.runner.watch import run_watch

        self.monkeypatch.setattr(attach_module, "attach", lambda pid, path, fixes, **_: server.attach_now(path))
        pid = server.scheduler_pid()
        self.thread = threading.Thread(
            target=lambda: setattr(self, "result", run_watch(pid, interval_s=1.0, trace_path=self.path, attach=True))
        )
        self.thread.start()
        probe_trace = self.path[: -len(".kvtrace.json")] + f".probe-{pid}.kvtrace.json"
        deadline = time.monotonic() + 120
        while not os.path.exists(probe_trace) and time.monotonic() < deadline:
            time.sleep(0.2)
        return probe_trace

    def findings(self) -> list:
        assert self.thread is not None
        self.thread.join(timeout=120)
        assert self.result is not None, "the watch did not end with the server"
        return self.result.findings


def test_leaks_before_and_after_an_attach_are_each_named_exactly(tmp_path, monkeypatch):
    """Page size 16, radix cache on, chunked prefill: one request's slots lost before the attach,
    another's after it. The first are named "leaked before attach", the second with their request
    and call site; each count exact, nothing else named. The attach is `watch --attach`'s, and the
    watch's own verdict is the same as a replay of the probe's trace (what `attach` leaves)."""
    watch = _WatchAttached(tmp_path, monkeypatch)
    server, trace = _serve_then_attach(
        tmp_path, ["--page-size", "16", "--chunked-prefill-size", "64"], fault="leak", fault_at="10,+2", watch=watch
    )
    watched = sorted((f.kind, f.count) for f in watch.findings() if f.severity == "error")
    plants = (server.fault() or {}).get("leak", {}).get("plants", [])
    assert [p["after_attach"] for p in plants] == [False, True], plants
    early, late = plants
    adopted = _adoption(trace)
    assert adopted["verified"] and adopted["held_by_no_one_slots"] == early["count"], adopted
    rc, report = sglang_server.replay(trace)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert rc == 1 and sorted(f["kind"] for f in errors) == ["orphan_slots", "orphan_slots"], errors
    named_early, named_late = sorted(errors, key=lambda f: "before kvdoctor attached" not in f["message"])
    assert "leaked before kvdoctor attached" in named_early["message"] and named_early["count"] == early["count"]
    page = early["page_size"]  # a lost page is named by all its slots, a request may have filled it partly

    def pages(slots: list[int]) -> set[int]:
        return {s // page for s in slots}

    assert pages(named_early["evidence"]["slot_ids"]) == pages(early["slot_ids"])
    assert named_late["count"] == late["count"] and pages(named_late["evidence"]["slot_ids"]) == pages(late["slot_ids"])
    assert "before kvdoctor attached" not in named_late["message"] and "rid " in named_late["message"]
    assert any("allocation.py" in site for site in named_late["evidence"]["allocated_at"])
    assert watched == sorted((f["kind"], f["count"]) for f in errors), watched
