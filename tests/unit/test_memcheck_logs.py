"""How the GPU server suite reads compute-sanitizer's memcheck logs (bench/gpu/server_suite.py,
bench/gpu/common.py), on lines as memcheck wrote them on the H200 (2026-12-02): the assert of
SGLang 0.5.23's store kernel, a summary whose second line counts the errors not printed, and a
log whose process was killed before memcheck summed up."""

import os
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench", "gpu"))

import server_suite
from common import memcheck_error_counts

ASSERTED = """========= COMPUTE-SANITIZER
========= Warp assert
=========     at void sglang::store_kvcache_kernel<256l, 256l, 32u, true, long>(sglang::StoreKVCacheParams)+0x2a0
=========     by thread (0,0,0) in block (0,0,0)
=========         Host Frame: forward in model_runner.py:1860
========= Warp assert
=========     at void sglang::store_kvcache_kernel<256l, 256l, 32u, true, long>(sglang::StoreKVCacheParams)+0x2a0
========= Target application returned an error
========= ERROR SUMMARY: 34 errors
========= ERROR SUMMARY: 14 errors were not printed. Use --print-limit option to adjust the number of printed errors
"""
KILLED = "========= COMPUTE-SANITIZER\n"


def test_the_summary_counts_each_error_once():
    assert memcheck_error_counts(ASSERTED) == [34]
    assert memcheck_error_counts("========= ERROR SUMMARY: 1 error\n") == [1]


def test_errors_are_counted_as_reported_and_a_killed_process_has_none(tmp_path):
    (tmp_path / "memcheck-598.log").write_text(ASSERTED)
    read = server_suite.memcheck_read(str(tmp_path))
    assert (read["errors"], read["errors_reported"], read["invalid_accesses"], read["logs"]) == (34, 2, 0, 1)
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "memcheck-1061.log").write_text(KILLED)
    read = server_suite.memcheck_read(str(killed))
    assert (read["summaries"], read["errors_reported"], read["logs"]) == ([], 0, 1)
