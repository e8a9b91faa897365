"""`kvdoctor demo --page-size 3` printed SGLang's "memory leak detected ... diff=2" beside
kvdoctor's "no findings" (#27, messages). kvdoctor was right: SGLang sizes every pool in whole
pages (`max_total_num_tokens // page_size * page_size`), so its paged allocator of 2048 slots in
pages of 3 serves 2046 and its idle check counts against 2046; the demo built the pool at 2048 and
counted against that. The demo pool is now sized as SGLang sizes it, and both counts agree.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import REPO, sglang_env

CHECK = (
    "import json; from kvdoctor.demo.workload import WorkloadConfig, run_workload; "
    "print(json.dumps({n: run_workload(WorkloadConfig(fault='none', page_size=n, turns=1)).sglang_check for n in (3, 5)}))"
)


def test_sglangs_own_check_is_clean_for_a_clean_run_at_any_page_size():
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", CHECK], capture_output=True, text=True, cwd=REPO, env=sglang_env("0.5.23"), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads(proc.stdout.strip().splitlines()[-1])
    for page_size, check in checks.items():
        assert check["diff"] == 0 and check["total"] % int(page_size) == 0, (page_size, check)


def test_the_demo_and_sglang_name_the_same_leak_at_page_size_3(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "demo", "--page-size", "3", "--trace", str(tmp_path / "demo.kvtrace.json")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sglang_says = int(re.search(r"memory leak detected! .* diff=(\d+)", proc.stdout).group(1))
    kvdoctor_says = int(re.search(r"ERROR orphan_slots x(\d+)", proc.stdout).group(1))
    assert sglang_says == kvdoctor_says, proc.stdout
    assert f"This is SGLang's 'memory leak detected ... diff={kvdoctor_says}', with names" in proc.stdout
