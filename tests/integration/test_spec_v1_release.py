"""EAGLE's first speculative path (`EAGLEWorker`; run on 0.5.5.post1, 0.5.6.post2, 0.5.7, 0.5.9 and
0.5.11) at page size > 1, topk 1 and 2: issue #25's speculative row (sglang#13741, PR#13826: the
paged draft and verify paths never update `kv_allocated_len`, "so release frees less than was
allocated").

On SGLang's real classes nothing leaks at release. Up to 0.5.7, at topk 2, `kv_allocated_len` is
indeed left at the prompt's length while the requests decode (pages held past it:
`beyond_allocated_len`; from 0.5.8 verify updates it at every topk), but the release does not go
by it: `pop_committed_kv_cache` gives the tree `len(origin_input_ids) + len(output_ids) - 1` at
topk > 1, `cache_finished_req` frees the committed tail's page whole, and verify has given back
every page past the last accepted token's. At topk 1 verify sets `kv_allocated_len =
kv_committed_len` on both paged branches. SGLang's own count (`available + evictable + protected`
against the pool) finds nothing missing after every request was released, at page sizes 4, 16 and
64, topk 1 and 2, on each release.

The probe must say the same. Before it followed the allocator's `restore_state`, it named this
path falsely: the draft's slots, taken by `alloc_paged_token_slots_extend(..., backup_state=True)`
and given back by `restore_state` (no `free`), stayed allocated in the ledger, so the next
`prepare_for_verify` or draft allocation of the same pages was a double allocation (every case),
and at topk 2 the exit census named the draft's pages as leaked ("allocated by ...
_draft_preprocess_decode"): 24, 160 and 512 slots at page sizes 4, 16 and 64 on 0.5.6.post2 and
0.5.7, 8, 80 and 512 on 0.5.5.post1, 0.5.9 and 0.5.11, while SGLang's count was 0.

tests/support/spec_v1_cases.py drives the path (its docstring names every kernel stood in), all
cases of a release in one process, each under its own trace.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import REPO, SUPPORT, error_findings, run_for_result, sglang_env

from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

CASES = [[4, 1], [16, 1], [64, 1], [4, 2], [16, 2], [64, 2]]
# release -> whether topk 2 leaves kv_allocated_len behind while decoding (PR#13826's condition)
STALE_AT_TOPK_2 = {"0.5.5.post1": True, "0.5.6.post2": True, "0.5.7": True, "0.5.9": False, "0.5.11": False}


@pytest.mark.parametrize("release", list(STALE_AT_TOPK_2))
def test_eagle_v1_paged_release_leaves_nothing_and_the_probe_names_nothing(tmp_path, release):
    traces = [str(tmp_path / f"spec-v1-{release}-{page}-{topk}.kvtrace.json") for page, topk in CASES]
    command = [sys.executable, os.path.join(SUPPORT, "spec_v1_cases.py"), json.dumps(CASES), *traces]
    results = run_for_result(command, env=sglang_env(release), cwd=REPO, timeout=300)
    for (page_size, topk), result, trace in zip(CASES, results, traces, strict=True):
        case = (release, page_size, topk)
        # the path ran as meant: every accept length, requests cut mid-path, every page accounted for
        assert result["accepted"] == [0, 1, 2, 3] and result["finished_mid_path"] > 0, (case, result)
        assert result["unpointed"] == 0, (case, result)  # between steps, no page held that no row or tree points at
        # PR#13826's condition: up to 0.5.7, at topk 2, the live rows hold pages past their kv_allocated_len
        assert (result["beyond_allocated_len"] > 0) == (topk > 1 and STALE_AT_TOPK_2[release]), (case, result)
        # SGLang's own count after every release: nothing missing
        assert result["sglang_unaccounted"] == 0, (case, result)
        events = list(iter_events(trace))
        assert [e.args for e in events if e.name == schema.VIOLATION] == [], case
        assert error_findings(events) == [], case
        exits = [e.args for e in events if e.name == schema.CENSUS and e.args.get("reason") == "exit"]
        assert len(exits) == 1, case
        # the ledger ends where the allocator's own lists end: the draft's pages were given back
        assert exits[0]["orphan_slots"] == 0 and exits[0]["free_slots"] == exits[0]["host_free_slots"] == result["available"], (case, exits)
