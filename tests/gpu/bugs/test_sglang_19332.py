"""sglang#19332 on SGLang 0.5.9's real HiCache stack on a GPU (sglang_19332_hicache.py): a multi-turn
chat workload driving a real HiRadixCache (pinned host pool, HiCacheController, L3 file storage) as
the scheduler does. Without a fix, the host indices each tree node keeps are views that pin whole
old copies of the host pool's free list, and anonymous memory grows; with `--fix
clone-host-indices` they are copies. Both runs side by side, each in its own process."""

import json
import os
import subprocess
import sys

import pytest

from .. import runs

pytestmark = pytest.mark.gpu

SECONDS = os.environ.get("HICACHE_SECONDS", "40")


def test_views_pin_old_free_lists_without_the_fix_and_not_with_it(tmp_path, sglang_env):
    env = sglang_env("0.5.9")
    started = {}
    for mode, fix in (("nofix", []), ("fix", ["--fix", "clone-host-indices"])):
        args = ["--seconds", SECONDS, *fix, "--trace", str(tmp_path / f"{mode}.trace.json"), "--out", str(tmp_path / f"{mode}.json")]
        command = [sys.executable, os.path.join(runs.BUGS, "sglang_19332_hicache.py"), *args]
        with open(tmp_path / f"{mode}.log", "w") as log:  # a file, not a pipe: neither run waits on the other's reader
            started[mode] = subprocess.Popen(command, env=env, cwd=runs.REPO, stdout=log, stderr=subprocess.STDOUT)
    out = {}
    for mode, proc in started.items():
        proc.wait(timeout=float(SECONDS) + 200)
        ended = (tmp_path / f"{mode}.log").read_text()[-3000:]
        assert proc.returncode == 0 and (tmp_path / f"{mode}.json").exists(), (mode, ended)
        out[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
        out[mode]["findings"] = runs.findings(str(tmp_path / f"{mode}.trace.json"))
    nofix, fix = out["nofix"], out["fix"]
    for run in (nofix, fix):
        assert run["probe"]["ledger_on"] and not run["probe"]["failures"], run["probe"]
        assert (run["summary"].get("backups") or 0) > 100, run["summary"]  # the workload reached write-through backups
    # ground truth, from the tree itself: without the fix the host values keep far more alive than their own bytes
    truth = nofix["ground_truth"]
    assert truth["retained_storage_bytes"] > 10 * truth["host_value_bytes"], truth
    truth = fix["ground_truth"]
    assert truth["retained_storage_bytes"] < 1.5 * truth["host_value_bytes"], truth
    # the probe's view of it
    assert "retained_view" in nofix["findings"], sorted(nofix["findings"])
    assert "retained_view" not in fix["findings"] and "fix_applied" in fix["findings"], sorted(fix["findings"])
    # and the process's memory: anonymous memory per 1000 backups grows several times faster without the fix
    grow = {mode: out[mode]["summary"]["RssAnon_MiB_per_1000_backups"] for mode in out}
    assert grow["nofix"] > 3 * max(grow["fix"], 1.0), grow
