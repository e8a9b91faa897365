"""The slot ledger on SGLang's real allocators, radix tree and request pool (0.5.23 and 0.5.9).

Each fault is planted the way it happens in a server; the workload computes the exact number of
slots it affects from the real indices, and the findings must name that number.
"""

import pytest
from conftest import run_cases

FAULTS_ALL_PAGES = ["none", "leak", "double-free", "index-out-of-range", "double-alloc", "row-leak", "double-free-in-call"]
CASES_0523 = [[ps, f] for ps in (1, 4) for f in FAULTS_ALL_PAGES + ["tree-unseen"]] + [[4, "stale-last-loc"]]
# 0.5.23's default tree, UnifiedRadixCache (a Rust tree core), under the same workload
CASES_0523_UNIFIED = [
    [ps, f, "unified"]
    for ps in (1, 4)
    for f in ("none", "leak", "double-free", "stale-last-loc")
    if not (ps == 1 and f == "stale-last-loc")
]
# 0.5.9's paged alloc_extend/alloc_decode launch Triton kernels unconditionally: CPU covers page_size 1.
CASES_059 = [[1, f] for f in FAULTS_ALL_PAGES + ["tree-unseen"]]


@pytest.fixture(scope="module")
def results_0523():
    return {(r["page_size"], r["fault"]): r for r in run_cases("0.5.23", CASES_0523)}


@pytest.fixture(scope="module")
def results_0523_unified():
    return {(r["page_size"], r["fault"]): r for r in run_cases("0.5.23", CASES_0523_UNIFIED)}


@pytest.mark.parametrize("case", CASES_0523_UNIFIED, ids=lambda c: f"ps{c[0]}-{c[1]}")
def test_sglang_0523_unified_tree(results_0523_unified, case):
    result = results_0523_unified[(case[0], case[1])]
    assert result["tree"] == "unified"
    check_case(result)


@pytest.fixture(scope="module")
def results_059():
    return {(r["page_size"], r["fault"]): r for r in run_cases("0.5.9", CASES_059)}


def errors(result):
    return [f for f in result["findings"] if f["severity"] == "error"]


def planted_site(result, kind):
    return [f for f in result["findings"] if f["kind"] == kind and "_finish" in f["site"] or (f["kind"] == kind and "_decode" in f["site"])]


def check_case(result):
    fault = result["fault"]
    planted = result["planted"]
    if fault == "none":
        assert errors(result) == [], result["findings"]
        assert result["sglang_check"]["diff"] == 0 and result["sglang_check"]["rows_diff"] == 0
        return
    if fault == "leak":
        leaks = [f for f in result["findings"] if f["kind"] == "orphan_slots"]
        assert len(leaks) == 1 and leaks[0]["count"] == planted["orphan_slots"]
        # the same number SGLang's own check prints as diff=N, but with the slots and request named
        assert result["sglang_check"]["diff"] == planted["orphan_slots"]
        assert "conv" in str(leaks[0]["evidence"]["requests"])
        assert len(leaks[0]["evidence"]["slot_ids"]) > 0
        assert [f["kind"] for f in errors(result)] == ["orphan_slots"]
    elif fault == "double-free":
        at_plant = [f for f in result["findings"] if f["kind"] == "double_free" and "_finish" in f["site"]]
        assert len(at_plant) == 1 and at_plant[0]["count"] == planted["double_free"]
    elif fault == "double-free-in-call":
        # Two slots named twice in one free: at one-slot pages SGLang's free list takes them twice
        # (named at the call, with the request); its paged free keeps each page once (nothing wrong).
        if result["page_size"] > 1:
            assert planted["double_free"] == 0 and errors(result) == [], result["findings"]
            assert result["sglang_check"]["diff"] == 0
            return
        first = errors(result)[0]
        assert first["kind"] == "double_free" and "_finish" in first["site"] and first["count"] == 2, first
        assert first["evidence"]["slot_ids"] == planted["slot_ids"], (first, planted)
        assert "conv" in str(first["evidence"]["requests"]), first["evidence"]
    elif fault == "stale-last-loc":
        stale = [f for f in result["findings"] if f["kind"] == "stale_last_loc" and "_decode" in f["site"]]
        assert stale and stale[0]["count"] >= planted["stale_last_loc"]
        assert stale[0]["evidence"]["requests"]
    elif fault == "index-out-of-range":
        oor = [f for f in result["findings"] if f["kind"] == "index_out_of_range" and "_decode" in f["site"]]
        assert oor, result["findings"]
        assert oor[0]["evidence"]["bad_index"] == result["sglang_check"]["total"] + result["page_size"]
    elif fault == "tree-unseen":
        # The last request's slots reach the tree past the hooked insert (as 0.5.23's HiCache load
        # back gave loaded slots to tree nodes): SGLang's books balance, the ledger's tree holds
        # fewer slots than SGLang's, and the ledger says it cannot judge instead of naming a leak.
        assert result["sglang_check"]["diff"] == 0
        assert errors(result) == [], result["findings"]
        unseen = [f for f in result["findings"] if f["kind"] == "probe_partial" and "tree_unseen_slots" in f["evidence"]]
        assert [f["evidence"]["tree_unseen_slots"] for f in unseen] == [planted["tree_unseen_slots"]], result["findings"]
        assert planted["tree_unseen_slots"] > 0
    elif fault == "row-leak":
        # The request's slots went back, its row never: SGLang's request pool check counts one row
        # missing; kvdoctor names that row and its request, and nothing else.
        assert result["sglang_check"]["rows_diff"] == 1 and result["sglang_check"]["diff"] == 0
        (named,) = [f for f in errors(result) if f["kind"] == "request_rows_leaked"]
        assert named["count"] == 1 and named["evidence"]["slot_ids"] == [planted["row"]], named
        assert list(named["evidence"]["requests"]) == [f"req_pool_idx {planted['row']} (rid {planted['rid']})"], named["evidence"]
        assert [f["kind"] for f in errors(result)] == ["request_rows_leaked"]
    elif fault == "double-alloc":
        kinds = {f["kind"] for f in errors(result)}
        assert "double_alloc" in kinds
        assert "use_after_free" in kinds or "tree_holds_free_slot" in kinds


@pytest.mark.parametrize("case", CASES_0523, ids=lambda c: f"ps{c[0]}-{c[1]}")
def test_sglang_0523(results_0523, case):
    result = results_0523[tuple(case)]
    assert result["version"] == "0.5.23"
    check_case(result)


@pytest.mark.parametrize("case", CASES_059, ids=lambda c: f"ps{c[0]}-{c[1]}")
def test_sglang_059(results_059, case):
    result = results_059[tuple(case)]
    assert result["version"] == "0.5.9"
    check_case(result)


# The native path's rules run again in Python (KVDOCTOR_NATIVE=0), one interpreter for these cases
CASES_PYTHON_PATH = [[1, "row-leak"], [1, "double-free-in-call"], [4, "double-free-in-call"]]


@pytest.fixture(scope="module")
def results_python_path():
    return {(r["page_size"], r["fault"]): r for r in run_cases("0.5.23", CASES_PYTHON_PATH, KVDOCTOR_NATIVE="0")}


@pytest.mark.parametrize("case", CASES_PYTHON_PATH, ids=lambda c: f"ps{c[0]}-{c[1]}")
def test_the_python_path_names_the_same(results_python_path, case):
    """The native path keeps each row's request (a weak reference) in C, the Python path in the
    table's own `allocated`; the native path marks each page its check passes, the Python path
    sorts the call's pages: both name a row left behind and a page named twice in one free."""
    check_case(results_python_path[tuple(case)])


def test_clean_runs_evict(results_0523):
    # a clean run that never evicted would not exercise the tree's frees
    assert results_0523[(1, "none")]["sglang_check"]["evictable"] > 0
