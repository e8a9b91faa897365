"""Issue #31's EAGLE item on SGLang 0.5.23: the draft/verify path's `last_loc` and `kv_allocated_len`
on paged allocation, checked before the kernel.

`tests/gpu/harness/eagle_last_loc.py --cpu` (its docstring says exactly what runs and what is stood in):
SGLang's own `ScheduleBatch.prepare_for_decode` -> `eagle_prepare_for_decode` ->
`alloc_for_spec_decode` (`get_last_loc` at the requests' `kv_allocated_len`, the real
`PagedTokenToKVPoolAllocator.alloc_extend`, page size 16, top-k 1) beside the real `RadixCache` and
`ReqToTokenPool`, the verify's K/V written into the real `MHATokenToKVPool`, the requests released
through SGLang's `release_kv_cache`. Request A finishes at its prefill; B takes A's row (rows are
reused without clearing) and C A's freed tail page. Both cases run in one process, each with its own
probe, pools and trace:

- clean: nothing found, no slot in two live rows, SGLang's own count accounts for every slot.
- reused-row: B's `kv_allocated_len` is left at A's 44, so `get_last_loc` reads A's old entry, in
  the page C now holds. The probe names `stale_last_loc` at the EAGLE site (alloc_for_spec_decode <
  eagle_prepare_for_decode), for B, with C as the page's holder, before alloc_extend runs; SGLang's own rows
  show the harm (8 slots in both B's and C's rows, B's verify writing over 4 of C's).

The GPU run, with the real Triton kernels under compute-sanitizer, is tests/gpu/test_eagle_last_loc.py.
"""

from __future__ import annotations

import os
import sys

from conftest import REPO, run_for_result, sglang_env

SCRIPT = os.path.join(REPO, "tests", "gpu", "harness", "eagle_last_loc.py")
EAGLE_SITE = "alloc_for_spec_decode (sglang/srt/mem_cache/allocation.py"


def test_eagle_decode_reused_row_stale_last_loc_is_named_at_the_eagle_site_and_clean_is_clean(tmp_path):
    command = [sys.executable, SCRIPT, "--cpu", "--case", "clean", "--case", "reused-row", "--traces", str(tmp_path)]
    result = run_for_result(command, env=sglang_env("0.5.23"), cwd=REPO, timeout=240)
    clean, reused = result["cases"]["clean"], result["cases"]["reused-row"]
    for case in (clean, reused):
        assert case["sglang"] == "0.5.23" and case["completed"] and case["probe"]["ledger_on"] and case["probe"]["failures"] == 0
        assert case["alloc_extend_hooked_as"] == "alloc_extend" and case["get_last_loc_hooked_as"] == "last_loc_source"
        # the scenario itself: A's tail page freed at its release, B in A's row, C on A's tail page
        assert case["A"]["tail_page_freed"] and case["B_takes_A_row"] and case["A"]["tail_page"] in case["C_pages"]

    # clean: nothing named, nothing shared, nothing unaccounted
    assert [f["kind"] for f in clean["findings"]] == []
    assert [s["slots_in_two_rows"] for s in clean["steps"]] == [0, 0, 0]
    assert clean["sglang_unaccounted"] == 0
    assert clean["last_loc_read"]["B"] // 16 not in clean["C_pages"]

    # reused-row: the last_loc B passes is A's old entry, in the page C holds
    a_tail = reused["A"]["tail_page"]
    assert reused["last_loc_read"]["B"] // 16 == a_tail and reused["steps"][0]["kv_allocated_len"]["B"] == 48
    # the harm, from SGLang's own rows: B's row [40, 48) and C's row [8, 16) are the same 8 slots,
    # and B's first verify writes its draft K/V over 4 of C's
    first = reused["steps"][0]
    assert first["slots_in_two_rows"] == 8 and first["slots_in_two_rows_by"] == ["B+C"]
    assert first["verify_writes_into_another_rows_slots"] == 4
    # named: stale_last_loc, once, at the EAGLE call site, the page's holder C
    stale = [f for f in reused["findings"] if f["kind"] == "stale_last_loc"]
    assert len(stale) == 1 and stale[0]["count"] == 1, reused["findings"]
    (site,) = stale[0]["violation_sites"]
    assert EAGLE_SITE in site and "eagle_prepare_for_decode (sglang/srt/speculative/eagle_utils.py" in site, site
    assert site.startswith("alloc_paged_token_slots_extend"), site  # the allocator call it reached, before the kernel ran
    assert stale[0]["evidence"]["slot_ids"] == list(range(a_tail * 16, a_tail * 16 + 16))
    assert list(stale[0]["evidence"]["requests"]) == [f"req_pool_idx {reused['C_row']} (rid C, live)"]
    # and the request whose last_loc it is: B, in A's old row (paired by get_last_loc's rows)
    passer = f"req_pool_idx {reused['B_row']} (rid B, live)"
    assert stale[0]["evidence"]["last_loc_of"] == {passer: 1} and f" for {passer} point at" in stale[0]["message"]
    assert {f["kind"] for f in reused["findings"]} == {"stale_last_loc"}
