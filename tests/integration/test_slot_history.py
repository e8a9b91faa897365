"""The slot ledger's flight recorder on the demo's planted faults, through SGLang's real allocator,
radix tree and request pool: each finding's history shows the transition that broke the books and
the ones before it, with the operations and call sites the workload made, in order; the native
path records exactly what the Python path records; and `kvdoctor replay --slot` reads it back."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, SUPPORT, sglang_env

CASES = [[1, "double-free"], [1, "double-alloc"], [1, "leak"], [4, "stale-last-loc"], [4, "relocate"], [1, "index-out-of-range"]]


def _line(needle: str, nth: int = 0) -> str:
    """`workload.py:N`, where the demo's workload makes the call `needle` names."""
    from kvdoctor.demo import workload

    lines, _ = inspect.getsourcelines(workload)  # a module's: from its first line
    found = [1 + i for i, text in enumerate(lines) if needle in text]
    return f"kvdoctor/demo/workload.py:{found[nth]})"


def _start(native: str) -> subprocess.Popen:
    env = dict(sglang_env("0.5.23"), KVDOCTOR_NATIVE=native, KVDOCTOR_IDLE_CENSUS_INTERVAL_S="0", KVDOCTOR_ROLLING_CENSUS_S="3600")
    cmd = [sys.executable, os.path.join(SUPPORT, "slot_history_cases.py"), json.dumps(CASES)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, err[-3000:]
    return {tuple(c["case"]): c for c in json.loads(lines[0][len("RESULT ") :])}


@pytest.fixture(scope="module")
def both_paths():
    from kvdoctor.probe import native

    python, compiled = _start("0"), _start("1") if native.active() else None  # both cores at once
    return _result(python), _result(compiled) if compiled is not None else None


def _first(case: dict, name: str, kind: str) -> list:
    event = next(e for e in case["events"] if e["name"] == name and e["kind"] == kind and e["history"])
    return event["history"]


def _ops(page: dict) -> list[tuple[str, str]]:
    return [(e["op"], e["site"].split(" < ")[0]) for e in page["entries"]]


def _victim() -> str:
    """The rid the demo's workload plants its fault in (its requests are `conv{c}-req{n}`)."""
    from kvdoctor.demo.workload import WorkloadConfig

    return f"-req{WorkloadConfig().victim}"


def _named_the_victim(entries: list) -> None:
    """Every entry with a row names the victim as the request the row served then; none without."""
    for e in entries:
        if isinstance(e["row"], int):
            assert e.get("rid", "").endswith(_victim()) and e["rid"].startswith("conv"), entries
        else:
            assert "rid" not in e, entries


def test_a_double_free_shows_both_frees_after_the_alloc_and_the_row(both_paths):
    python, _ = both_paths
    pages = _first(python[(1, "double-free")], "violation", "double_free")
    first_free, second_free = _line("engine.allocator.free(own)", 0), _line("engine.allocator.free(own)", 1)
    for page in pages:
        ops = _ops(page)
        assert [op for op, _ in ops[-4:]] == ["alloc", "owner", "free", "free"], ops
        assert ops[-2][1].endswith(first_free) and ops[-1][1].endswith(second_free), ops
        assert ops[-4][1].startswith(("_prefill", "_decode")), ops
        rows = [e["row"] for e in page["entries"][-3:]]
        assert rows[0] == rows[1] == rows[2] and isinstance(rows[0], int), rows  # the victim's row took it, then freed it twice
        _named_the_victim(page["entries"][-4:])  # and each of the three names the victim's rid
    assert len(pages) == 8  # a bounded sample of the 64 slots it names


def test_a_double_alloc_shows_the_free_of_tree_held_slots_then_the_alloc(both_paths):
    python, _ = both_paths
    planted = _line("engine.allocator.free(victim_slots)")
    for page in _first(python[(1, "double-alloc")], "violation", "double_alloc"):
        ops = _ops(page)
        assert [op for op, _ in ops[-3:]] == ["tree", "free", "alloc"], ops
        assert ops[-3][1].startswith("insert (kvdoctor/demo/engine.py") and ops[-2][1].endswith(planted), ops
        assert ops[-1][1].startswith(("_prefill", "_decode")), ops


@pytest.mark.parametrize(
    ("fault", "needle"), [("stale-last-loc", "last_page_start + ps"), ("relocate", "int(old_page[0]) // ps * ps + ps")]
)
def test_a_stale_last_loc_shows_the_page_freed_under_it_then_the_read(both_paths, fault, needle):
    python, _ = both_paths
    (page,) = _first(python[(4, fault)], "violation", "stale_last_loc")
    ops = _ops(page)
    alloc_decode = _line("engine.allocator.alloc_decode(")
    assert [op for op, _ in ops] == ["alloc", "owner", "free", "last_loc"], ops
    assert ops[0][1].endswith(alloc_decode) and ops[2][1].endswith(_line(needle)) and ops[3][1].endswith(alloc_decode), ops
    rows = [e["row"] for e in page["entries"]]
    assert rows[1] == rows[2] == rows[3], rows  # the request's own page, freed, then read as its last_loc
    _named_the_victim(page["entries"])


def test_a_leak_shows_the_orphans_taken_and_never_given_back(both_paths):
    python, _ = both_paths
    case = python[(1, "leak")]
    censuses = [e for e in case["events"] if e["name"] == "census"]
    named = [e for e in censuses if e["history"]]
    assert censuses[-1]["kind"] == "exit" and len(named[-1]["history"]) == 8
    # the censuses after the first that named them say only that nothing changed
    after = censuses[censuses.index(named[0]) + 1 :]
    assert len(named) == 1 and after and all(e["unchanged"] for e in after), censuses
    for page in named[-1]["history"]:
        ops = _ops(page)
        assert [op for op, _ in ops[-2:]] == ["alloc", "owner"] and ops[-2][1].startswith(("_prefill", "_decode")), ops
        _named_the_victim(page["entries"][-2:])
        # the row has served later requests since: the entry names the one it served then
        row_now = case["rows_now"][str(page["entries"][-1]["row"])]
        assert _victim() + "," not in row_now and "rid conv" in row_now, row_now


def test_a_leak_at_release_carries_the_histories_then(both_paths):
    """The release that leaks names the pages' histories at once, while the request is recent."""
    python, _ = both_paths
    (release,) = [e for e in python[(1, "leak")]["events"] if e["name"] == "violation" and e["kind"] == "orphan_slots"]
    assert len(release["history"]) == 8
    for page in release["history"]:
        assert [e["op"] for e in page["entries"]][-2:] == ["alloc", "owner"]
        _named_the_victim(page["entries"][-2:])


def test_an_index_out_of_range_names_no_page_to_show(both_paths):
    python, _ = both_paths
    events = [e for e in python[(1, "index-out-of-range")]["events"] if e["kind"] == "index_out_of_range"]
    assert events and not any(e["history"] for e in events)


def test_the_native_path_records_what_the_python_path_records(both_paths):
    python, compiled = both_paths
    if compiled is None:
        pytest.skip("the native path is not built here")
    for key, case in python.items():
        assert not case["compiled"] and compiled[key]["compiled"]
        assert case["entries"] == compiled[key]["entries"] and all(n == 8 for n in case["entries"].values())
        assert case["events"] == compiled[key]["events"], key


def test_replay_prints_one_slots_history_and_says_when_it_has_none(tmp_path):
    trace = tmp_path / "t.kvtrace.json"
    cmd = [sys.executable, "-m", "kvdoctor.cli", "demo", "--fault", "double-free", "--trace", str(trace), "--format", "json"]
    demo = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    report = json.loads(demo.stdout)
    finding = next(f for f in report["findings"] if f["kind"] == "double_free")
    page = finding["evidence"]["history"][0]
    assert [e["op"] for e in page["entries"]][-2:] == ["free", "free"]  # JSON carries it
    slot = page["first_slot"]
    shown = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "replay", "--slot", str(slot), str(trace)], capture_output=True, text=True, cwd=REPO
    )
    assert shown.returncode == 0 and f"history of slot {slot}," in shown.stdout, shown.stderr
    assert shown.stdout.count(" free ") >= 2 and " alloc " in shown.stdout
    assert shown.stdout.count(f"{_victim()})") >= 3, shown.stdout  # the row's owner then: "row 63 (rid conv9-req9)"
    # Perfetto: the same entries as instant events on the slot's own track, oldest first, each at or
    # before the violation that dumped it
    raw = [json.loads(line.rstrip(",\n")) for line in trace.read_text().splitlines() if line.startswith("{")]
    (track,) = [e["tid"] for e in raw if e["name"] == "thread_name" and e["args"]["name"].startswith(f"slot {slot} (")]
    marks = [e for e in raw if e["tid"] == track and e["ph"] == "i"]
    violation = next(e for e in raw if e["name"] == "violation" and e["args"].get("kind") == "double_free")
    dumped, later = marks[: len(page["entries"])], marks[len(page["entries"]) :]  # later: what a later census dumped, new entries only
    assert [e["name"] for e in dumped] == [e["op"] for e in page["entries"]] and {e["s"] for e in marks} == {"t"}
    assert [e["args"]["seq"] for e in dumped] == [e["seq"] for e in page["entries"]]
    assert [e["args"].get("rid") for e in dumped] == [e.get("rid") or None for e in page["entries"]]
    assert all(a["ts"] <= b["ts"] for a, b in zip(dumped, dumped[1:], strict=False)) and dumped[-1]["ts"] <= violation["ts"]
    assert all(e["args"]["seq"] > dumped[-1]["args"]["seq"] for e in later) and all(e["args"]["dumped_by"] != "double_free" for e in later)
    names = [e["args"]["name"] for e in raw if e["name"] == "thread_name"]
    for dumped_page in violation["args"]["history"]:  # one track a page, however often it is dumped
        assert sum(name.startswith(f"slot {dumped_page['first_slot']} (") for name in names) == 1, names
    leak_cmd = [
        sys.executable,
        "-m",
        "kvdoctor.cli",
        "demo",
        "--fault",
        "leak",
        "--trace",
        str(tmp_path / "l.kvtrace.json"),
        "--format",
        "json",
    ]
    leak = subprocess.run(leak_cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    orphans = next(f for f in json.loads(leak.stdout)["findings"] if f["kind"] == "orphan_slots")
    assert [e["op"] for e in orphans["evidence"]["history"][0]["entries"]][-2:] == ["alloc", "owner"]  # the exit census's, carried over
    none = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "replay", "--slot", "3", str(trace)], capture_output=True, text=True, cwd=REPO
    )
    assert none.returncode == 0 and "holds no history of slot 3" in none.stdout
