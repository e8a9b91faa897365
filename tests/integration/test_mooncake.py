"""SGLang's HiCache L3 `mooncake` backend on a real Mooncake store: a local `mooncake_master` over
TCP, SGLang 0.5.9's real HiRadixCache, HiCacheController, host pool (allocated by Mooncake) and
MooncakeStore (tests/support/mooncake_l3.py). The probe's L3 ledger is checked against what the
master and SGLang themselves count, and sglang#19332's growth is shown with this backend: the store
stays inside its segment while the host-index views grow past it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SUPPORT, sglang_env

sys.path.insert(0, SUPPORT)

import mooncake_l3

PAGE = 16
MIB = 1 << 20


@pytest.fixture(scope="module")
def env():
    environment = mooncake_l3.mooncake_env(sglang_env("0.5.9"))
    reason = mooncake_l3.unavailable_reason(environment)
    if reason:
        pytest.skip(reason)
    return environment


def run(env, tmp_path, name, *args):
    """One workload against a fresh master; the master's metrics are read as the client exits
    (before its 10 s heartbeat lease could drop the client's segment)."""
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.trace.reader import iter_events

    trace = str(tmp_path / f"{name}.json")
    master = mooncake_l3.Master(env, str(tmp_path / f"{name}-master.log"))
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(SUPPORT, "mooncake_l3.py"), "--master", master.address, "--trace", trace, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=REPO,
        )
        metrics = master.metrics()
    finally:
        master.stop()
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    events = list(iter_events(trace))
    return {
        "result": json.loads(line[-1][len("RESULT ") :]),
        "metrics": metrics,
        "events": events,
        "findings": {f.kind: f for f in analyze(iter(events)).findings},
    }


@pytest.fixture(scope="module")
def read_back(env, tmp_path_factory):
    """A small host pool: old turns fall out of it and come back from the store, whose segment is
    large enough that it evicts nothing (so every page written is there to be read)."""
    return run(env, tmp_path_factory.mktemp("read-back"), "read-back", "--batches", "60", "--host-ratio", "2", "--segment-mib", "128")


@pytest.fixture(scope="module")
def growth(env, tmp_path_factory):
    """A large host pool and a small store segment: the store fills and evicts, the tree keeps views."""
    return run(env, tmp_path_factory.mktemp("growth"), "growth", "--batches", "150", "--host-ratio", "8", "--segment-mib", "16")


def ledger(run_result):
    """The last `l3_keys` summary the probe wrote."""
    summaries = [e.args for e in run_result["events"] if e.name == "l3_keys"]
    assert summaries, "no l3_keys event in the trace"
    return summaries[-1]


def test_the_ledger_counts_what_the_master_stored_and_sglang_loaded(read_back):
    info, stats, metrics = read_back["result"]["info"], read_back["result"]["stats"], read_back["metrics"]
    l3 = ledger(read_back)
    assert info["storage_backend"] == "MooncakeStore" and info["host_allocator"] == "MooncakeHostTensorAllocator"
    assert l3["backends"] == {"MooncakeStore": info["page_bytes"]}
    # Every page is a K and a V object in the store; the store's own warm-up key is the one more.
    assert metrics["master_evicted_key_count"] == 0
    stored_ever = metrics["master_key_count"] + metrics["master_evicted_key_count"]
    assert stored_ever == 2 * l3["keys_written"] + 1
    assert l3["set_failed_pages"] == 0 and l3["untracked_keys"] == 0
    assert l3["keys_written"] + l3["set_again_pages"] == l3["set_pages"]
    # The store's own read counts: two objects per page read back, plus its warm-up read.
    assert metrics["valid_get_nums_"] == 2 * l3["get_hit_pages"] + 1
    assert metrics["mem_cache_hit_bytes_total"] == l3["get_hit_pages"] * info["page_bytes"] + 4096
    assert metrics["total_get_nums_"] - metrics["valid_get_nums_"] == 2 * l3["get_miss_pages"]
    # SGLang counts as loaded from L3 only the pages it did not find in host memory meanwhile.
    assert l3["get_hit_pages"] > 0 and stats["l3_loaded_tokens"] <= l3["get_hit_pages"] * PAGE
    assert 0 < l3["keys_read"] <= l3["get_hit_pages"] and l3["get_miss_pages"] == 0
    assert l3["exists_hit_pages"] >= l3["get_hit_pages"]
    assert l3["reads_of_unwritten"] == 0 and l3["read_misses_of_written"] == 0
    assert l3["keys_never_read"] == l3["keys_written"] - l3["keys_read"] > 0
    assert l3["bytes_never_read"] == l3["keys_never_read"] * info["page_bytes"]
    assert len(l3["sample_unread_keys"]) > 0 and l3["untracked_keys"] == 0


def test_bytes_in_the_store_over_time_are_counters(read_back):
    counters = [e.args for e in read_back["events"] if e.name == "l3_store"]
    assert len(counters) >= 2
    written = [c["distinct_key_bytes"] for c in counters]
    assert written == sorted(written) and written[-1] == ledger(read_back)["distinct_key_bytes"]


def test_the_finding_says_the_store_is_bounded_when_nothing_else_grows(read_back):
    finding = read_back["findings"]["l3_store_bytes"]
    l3 = ledger(read_back)
    assert finding.count == l3["keys_never_read"]
    assert "bounded by at most its 128.0 MiB segment" in finding.message
    assert f"{l3['keys_written']} pages written" in finding.message and f"{l3['keys_read']} read back" in finding.message


def test_the_key_ledger_is_bounded(monkeypatch):
    """Past MAX_KEYS the ledger counts pages without keeping their keys."""
    from kvdoctor.probe.engines.sglang import mooncake_ledger

    monkeypatch.setattr(mooncake_ledger, "MAX_KEYS", 100)
    ledger_state = mooncake_ledger.L3Ledger()
    keys = [f"{i:064x}" for i in range(250)]
    ledger_state.on_set(object(), keys, [True] * 250)
    ledger_state.on_get(object(), keys[:10] + ["never-written"], [True] * 10 + [False])
    summary = ledger_state.summary()
    assert summary["tracked_keys"] == 100 and summary["untracked_keys"] == 150
    assert summary["keys_written"] == 100 and summary["keys_read"] == 10 and summary["keys_never_read"] == 90
    assert summary["untracked_reads"] == 1 and summary["reads_of_unwritten"] == 0  # full: it cannot tell
    assert len(summary["sample_unread_keys"]) <= mooncake_ledger.SAMPLE_KEYS
    roomy = mooncake_ledger.L3Ledger()
    roomy.on_set(object(), keys[:5], [True] * 5)
    roomy.on_get(object(), ["never-written", keys[0]], [False, True])
    summary = roomy.summary()
    assert summary["reads_of_unwritten"] == 1 and summary["sample_unwritten_keys"] == ["never-written"]
    assert summary["keys_read"] == 1 and summary["keys_never_read"] == 4 and summary["untracked_reads"] == 0


def test_19332_grows_past_the_store_and_the_finding_names_it(growth):
    truth, metrics = growth["result"]["truth"], growth["metrics"]
    l3 = ledger(growth)
    segment = 16 * MIB
    assert l3["segment_bytes"] == segment
    # The store evicted and stayed inside its segment; the ledger saw far more than that written.
    assert metrics["master_evicted_key_count"] > 0 and metrics["master_allocated_bytes"] <= segment
    assert l3["distinct_key_bytes"] > 4 * segment
    # SGLang's own tree: its host_value views pin far more than the store holds (sglang#19332).
    assert truth["retained_storage_bytes"] > 2 * segment and truth["retained_storage_bytes"] > 8 * truth["host_value_bytes"]
    views = growth["findings"]["retained_view"]
    assert views.evidence["retained_bytes"] > 2 * segment
    finding = growth["findings"]["l3_store_bytes"]
    assert finding.severity == "warning"
    assert finding.message.startswith("Host memory grows because of sglang#19332, not the L3 store (MooncakeStore)")
    assert finding.evidence["store_bytes_bound"] == segment
    samples = growth["result"]["samples"]
    assert samples[-1]["RssAnon"] - samples[0]["RssAnon"] > 2 * segment
