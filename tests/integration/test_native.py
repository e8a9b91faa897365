"""The native path against the pure-Python one, on the real SGLang allocator, radix tree and
request pool: the same ledgers (page by page, call sites as text), the same violations, censuses
and statuses, the same host results; the healthy calls really take the native path; and a
failure inside it turns the probe off without touching the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, SUPPORT, sglang_env

native = pytest.importorskip("kvdoctor.probe.native")
pytestmark = pytest.mark.skipif(not native.active(), reason="the native path is not built here")

FAULTS = ("none", "leak", "double-free", "stale-last-loc", "relocate", "index-out-of-range", "double-alloc")
CASES = [[page_size, fault, tree] for page_size in (1, 4) for fault in FAULTS for tree in ("radix", "unified")]
CASES += [[1, "double-free", "radix", ["double-free"]], [4, "stale-last-loc", "radix", ["stale-last-loc"]]]
# 0.5.9's paged allocator launches Triton kernels (the GPU machine's); its page_size 1 path is the host's
CASES_059 = [[1, fault, "radix"] for fault in FAULTS]


# the build this process runs (CI's sanitizer run names its own: KVDOCTOR_NATIVE=<path>), or the package's
COMPILED_BUILD = os.environ.get("KVDOCTOR_NATIVE", "") if os.path.isfile(os.environ.get("KVDOCTOR_NATIVE", "")) else "1"


def _start(compiled: bool, version: str, cases: list) -> subprocess.Popen:
    env = dict(
        sglang_env(version),
        KVDOCTOR_NATIVE=COMPILED_BUILD if compiled else "0",
        # the idle census is taken by whichever thread comes first: keep it on the scheduler's
        KVDOCTOR_IDLE_CENSUS_INTERVAL_S="0",
        KVDOCTOR_ROLLING_CENSUS_S="3600",
    )
    if not compiled:  # none of the C runs there: a sanitizer runtime (.ci/sanitize) would only slow it
        env.pop("LD_PRELOAD", None)
    cmd = [sys.executable, os.path.join(SUPPORT, "native_cases.py"), json.dumps(cases)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, err[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module", params=(1, 4), ids=lambda page_size: f"page_size_{page_size}")
def both_paths(request):
    """The cases of one page size on both paths (.ci/sanitize takes page size 4's: every fast path
    and every fault, at half the time)."""
    cases = [case for case in CASES if case[0] == request.param]
    python, compiled = _start(False, "0.5.23", cases), _start(True, "0.5.23", cases)  # both cores at once
    return cases, _result(python), _result(compiled)


def _same(python: list[dict], compiled: list[dict], cases: list) -> None:
    assert len(python) == len(compiled) == len(cases)
    for py, c in zip(python, compiled, strict=True):
        assert not py["compiled"] and c["compiled"]
        for key in ("ledgers", "row_extent", "events", "calls", "failures", "ledger_on", "planted", "digest", "sglang_check"):
            assert py[key] == c[key], (c["case"], key)


def test_the_compiled_path_leaves_exactly_what_the_python_path_leaves(both_paths):
    cases, python, compiled = both_paths
    _same(python, compiled, cases)
    # the comparison has teeth: the faults were found, with slot ids and call sites as evidence
    page = cases[0][0]
    found = {tuple(c["case"][:3]): [e for e in c["events"] if e["name"] == "violation"] for c in compiled}
    assert found[(page, "double-free", "radix")] and all(e["args"]["site"] for e in found[(page, "double-free", "radix")])
    assert found[(page, "index-out-of-range", "unified")]
    assert page == 1 or found[(page, "stale-last-loc", "radix")]  # a stale last_loc is met by paged allocations
    assert not found[(page, "none", "radix")] and not found[(page, "none", "unified")]


def test_healthy_calls_take_the_compiled_path(both_paths):
    _, _, compiled = both_paths
    for case in compiled:
        if case["case"][1] != "none":
            continue
        fast, diverted, slow = (sum(case["paths"][k]) for k in ("fast", "diverted", "slow"))
        assert fast > 1000 and slow == 0 and diverted <= fast // 100, (case["case"], case["paths"])
    # what the equality above covered: tensors read through torch's DLPack table (torch >= 2.11 has
    # one) and call sites keyed from the interpreter's frame records (3.11 and 3.12)
    assert all(case["readers"] == {"dlpack_reader": True, "direct_frames": True} for case in compiled)


def test_the_dlpack_reader_reads_what_the_getters_read():
    """The samples the extension checks before trusting torch's DLPack table, and more: both
    readers give the same element count, width, address and value, or both decline."""
    import torch

    native.ensure_torch()
    assert native.NATIVE.stats()["dlpack_reader"]
    base = torch.arange(40, dtype=torch.int64)
    more = [base[3:], base[::5], base.view(5, 8)[:, ::2], base.view(8, 5)[2], torch.tensor([7], dtype=torch.int32)]
    more += [base.view(2, 20).t().contiguous(), torch.empty(0, 3, dtype=torch.int64), base.to(torch.float64)]
    for tensor in native.index_samples(torch) + more:
        assert native.NATIVE.readers_agree(tensor), (tensor.shape, tensor.stride(), tensor.dtype)
    meta = torch.empty(4, dtype=torch.int64, device="meta")
    assert native.NATIVE.readers_agree(meta)  # DLPack declines it: the getters are asked


def test_the_in_place_reader_reads_what_dlpack_reads_and_leaves_the_rest_to_it():
    """torch's own tensor fields, at the places learned at start: every contiguous CPU index
    tensor is read there, alike with DLPack; anything else (strided, other dtypes, more than the
    inline dimensions, meta, subclasses) is left to DLPack."""
    import torch

    native.ensure_torch()
    ext = native.NATIVE
    assert ext.stats()["direct_reader"]
    base = torch.arange(60, dtype=torch.int64)
    with torch.inference_mode():
        inference = torch.arange(9, dtype=torch.int32)[1:]
    read_here = [base, base[7:31], base.view(6, 10)[4], base.view(6, 10)[2:3], base.to(torch.int32)[2:]]
    read_here += [inference, torch.tensor(5), torch.empty(0, dtype=torch.int64), base.view(3, 4, 5)[1:]]
    left = [base[::2], base.view(6, 10).t(), base.view(6, 10)[:, 3:4].t(), base.to(torch.float32), base.to(torch.int16)]
    left += [base.view(1, 2, 3, 2, 5, 1)]  # more dimensions than torch keeps inline
    left += [torch.empty(3, dtype=torch.int64, device="meta")]
    for tensor in read_here + left:
        assert ext.readers_agree(tensor), (tensor.shape, tensor.stride(), tensor.dtype)
    assert [ext.read_in_place(t) for t in read_here] == [True] * len(read_here)
    assert [ext.read_in_place(t) for t in left] == [False] * len(left)
    assert not ext.read_in_place(torch.nn.Parameter(base.float()))  # a subclass: not read by any reader here


def test_the_in_place_reader_is_compared_with_dlpack_and_turns_off_on_a_difference(tmp_path, monkeypatch):
    """On the real workload every in-place read compared with DLPack's agrees; a layout misread
    (as on a torch we misunderstood) is caught at the first compared read, turns the in-place
    reader off, and the ledger still comes out as DLPack reads it."""
    import torch

    from kvdoctor.demo.engine import Engine
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    from kvdoctor.probe.base.vocabulary import OWNED
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang.state import sglang_state

    ext = native.NATIVE
    native._TORCH_SEEN = None  # learn afresh: the counters start at zero
    runtime.activate(str(tmp_path / "inplace.json"))
    try:
        ext.direct_check_every(1)
        run_workload(WorkloadConfig(page_size=1, conversations=4, turns=2, pool_tokens=1024))
        stats = ext.stats()
        assert stats["direct_reader"] and stats["direct_mismatches"] == 0
        assert stats["direct_checked"] == stats["direct_reads"] > 100

        engine = Engine(pool_tokens=256, page_size=1)
        ledger = sglang_state(runtime.current()).ledger_for(engine.allocator)
        ext.direct_misread()
        slots = engine.allocator.alloc(6)  # an int64 tensor, now misread as int32
        stats = ext.stats()
        assert not stats["direct_reader"] and stats["direct_mismatches"] == 1
        assert [int(ledger.state[int(s)]) for s in slots] == [OWNED] * 6
        assert ext.readers_agree(torch.arange(5))
    finally:
        ext.direct_check_every(0)
        runtime.deactivate()
        native._TORCH_SEEN = None
        native.ensure_torch()  # learned again: on for the tests after this one
    assert ext.stats()["direct_reader"]
    monkeypatch.setenv(native.ENV_DIRECT, "0")
    native.ensure_torch()
    assert not ext.stats()["direct_reader"] and ext.stats()["dlpack_reader"]
    monkeypatch.delenv(native.ENV_DIRECT)
    native.ensure_torch()
    assert ext.stats()["direct_reader"]


def test_the_compiled_path_on_sglang_0_5_9_leaves_exactly_what_the_python_path_leaves():
    python, compiled = _start(False, "0.5.9", CASES_059), _start(True, "0.5.9", CASES_059)
    python_result, compiled_result = _result(python), _result(compiled)
    _same(python_result, compiled_result, CASES_059)
    double_free = next(c for c in compiled_result if c["case"][1] == "double-free")
    assert [e for e in double_free["events"] if e["name"] == "violation"]


# req_free_rows is reached here only inside free(req), which records the release itself (composite)
KINDS_THAT_FAIL = ("alloc", "free", "tree_insert", "req_write", "req_free", "last_loc")


def _workload(fault: str = "none") -> list:
    from kvdoctor.demo.workload import WorkloadConfig, run_workload

    out = []
    for page_size in (1, 4):
        result = run_workload(WorkloadConfig(fault=fault, page_size=page_size, turns=3))
        out.append((result.outputs_digest, result.sglang_check, result.planted))
    return out


def test_a_failure_inside_a_compiled_fast_path_turns_the_probe_off_and_spares_the_host(tmp_path):
    """Each fast path that writes the ledger, made to raise after the host's call: the host's
    results are those of a run without the probe, the probe says it is off and why."""
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.probe.core import runtime
    from kvdoctor.trace.reader import iter_events

    baseline = _workload()
    for kind in KINDS_THAT_FAIL:
        path = str(tmp_path / f"{kind}.json")
        runtime.activate(path)
        native.NATIVE.fail_after(native.KINDS[kind])
        try:
            assert _workload() == baseline, kind
        finally:
            runtime.deactivate()
        findings = analyze(iter_events(path)).findings
        off = [f for f in findings if f.kind == "probe_off"]
        assert off and "fault injected into the" in off[0].message, (kind, [f.kind for f in findings])
        assert not [f for f in findings if f.severity == "error"], kind


def _probe_off_message(path: str) -> str:
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.trace.reader import iter_events

    findings = analyze(iter_events(path)).findings
    assert not [f for f in findings if f.severity == "error"]
    return next((f.message for f in findings if f.kind == "probe_off"), "")


def test_free_rows_called_by_itself_is_recorded_and_its_failure_spares_the_host(tmp_path):
    """Beam search releases rows with `free_rows` directly (not through `free(req)`): the compiled
    path records that release, and a failure inside it leaves the host's pool as without the probe."""
    from kvdoctor.demo.engine import Engine, Request
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang.state import sglang_state

    def release_by_rows(fail: bool) -> tuple[list, set]:
        probe = runtime.activate(str(tmp_path / f"rows-{fail}.json"))
        try:
            engine = Engine(pool_tokens=256, page_size=1)
            reqs = [Request(f"beam-{i}") for i in range(3)]
            for req in reqs:
                engine.take_row(req)
            rows = [req.kv.req_pool_idx for req in reqs]
            if fail:
                native.NATIVE.fail_after(native.KINDS["req_free_rows"])
            engine.req_pool.free_rows(rows[:2])
            return sorted(engine.req_pool.free_slots), set(sglang_state(probe).requests.live)
        finally:
            native.NATIVE.fail_after(-1)
            runtime.deactivate()

    free_slots, live = release_by_rows(fail=False)
    assert len(live) == 1 and _probe_off_message(str(tmp_path / "rows-False.json")) == ""
    failed_free_slots, _ = release_by_rows(fail=True)
    assert failed_free_slots == free_slots
    assert "fault injected into the" in _probe_off_message(str(tmp_path / "rows-True.json"))


def test_the_compiled_path_keeps_the_request_table_as_its_methods_do(tmp_path, monkeypatch):
    """The native path changes the request table's dicts itself: each row's rid live while held,
    then finished, a row taken again live once more, and only the newest `max_finished` finished
    rows remembered, oldest forgotten first, as `RequestTable.freed` keeps them."""
    from kvdoctor.demo.engine import Engine, Request
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang.state import sglang_state
    from kvdoctor.probe.ledgers.requests import RequestTable

    monkeypatch.setattr(RequestTable, "max_finished", 3)
    probe = runtime.activate(str(tmp_path / "table.json"))
    try:
        engine = Engine(pool_tokens=256, page_size=1)
        table = sglang_state(probe).requests
        before = native.NATIVE.stats()["fast"]
        reqs = [Request(f"table-{i}") for i in range(6)]
        for req in reqs[:5]:
            engine.take_row(req)
        rows = {req.rid: int(req.kv.req_pool_idx) for req in reqs[:5]}
        assert table.live == {row: rid for rid, row in rows.items()}
        for req in reqs[:5]:
            engine.release_row(req)
        assert table.live == {} and table.finished == {rows[f"table-{i}"]: f"table-{i}" for i in (2, 3, 4)}
        engine.take_row(reqs[5])  # takes a row a finished request held
        row = int(reqs[5].kv.req_pool_idx)
        assert table.live == {row: "table-5"} and row not in table.finished
        assert table.describe(row) == f"req_pool_idx {row} (rid table-5, live)"
        fast = [n - m for n, m in zip(native.NATIVE.stats()["fast"], before, strict=True)]
        assert fast[native.KINDS["req_alloc"]] == 6 and fast[native.KINDS["req_free"]] == 5  # all of them in C
    finally:
        runtime.deactivate()


def test_the_ledger_lock_is_reentrant_owned_and_survives_fork():
    lock = native.new_lock()
    with lock:
        with lock:  # the census takes it inside a hooked call that holds it
            assert lock._is_owned()
        taken_elsewhere = []
        worker = threading.Thread(target=lambda: taken_elsewhere.append(lock.acquire(blocking=False)))
        worker.start()
        worker.join()
        assert taken_elsewhere == [False]
    assert not lock._is_owned()
    # a thread that lets go of the GIL inside the lock (time.sleep) keeps it: another thread waits
    order, held = [], threading.Event()

    def holder() -> None:
        with lock:
            order.append("held")
            held.set()
            time.sleep(0.2)
            order.append("released")

    worker = threading.Thread(target=holder)
    worker.start()
    held.wait()
    with lock:
        order.append("taken")
    worker.join()
    assert order == ["held", "released", "taken"]
    with pytest.raises(RuntimeError):
        lock.release()
    assert lock.acquire(blocking=False)
    pid = os.fork()  # a child forked while the parent holds the lock can still take it
    if pid == 0:
        os._exit(0 if lock.acquire(blocking=False) else 1)
    _, status = os.waitpid(pid, 0)
    lock.release()
    assert os.WEXITSTATUS(status) == 0


def test_a_fast_path_waits_for_a_ledger_lock_another_thread_holds(tmp_path):
    """A fast path leaves the ledger's lock alone only where nobody holds it. Held by a thread
    that let go of the GIL inside (a census in the writer thread), the allocation's ledger update
    waits for it, and is recorded once it is released."""
    from kvdoctor.demo.engine import Engine
    from kvdoctor.probe.base.vocabulary import FREE, OWNED
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang.state import sglang_state

    runtime.activate(str(tmp_path / "held.json"))
    try:
        engine = Engine(pool_tokens=256, page_size=1)
        ledger = sglang_state(runtime.current()).ledger_for(engine.allocator)
        order, held, seen = [], threading.Event(), {}

        def holder() -> None:
            with ledger.lock:
                order.append("held")
                held.set()
                time.sleep(0.3)
                seen["while_held"] = int((ledger.state == OWNED).sum())
                order.append("released")

        worker = threading.Thread(target=holder)
        worker.start()
        held.wait()
        before = native.NATIVE.stats()["fast"][native.KINDS["alloc"]]
        slots = engine.allocator.alloc(5)
        order.append("allocated")
        worker.join()
        assert order == ["held", "released", "allocated"]
        assert seen["while_held"] == 0  # nothing changed under the holder
        assert native.NATIVE.stats()["fast"][native.KINDS["alloc"]] == before + 1
        assert all(ledger.state[int(s)] == OWNED for s in slots)
        engine.allocator.free(slots)
        assert all(ledger.state[int(s)] == FREE for s in slots)
    finally:
        runtime.deactivate()
