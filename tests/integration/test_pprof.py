"""Attribution windows as pprof profiles, read back by a real reader: Go's own pprof tool
(Debian's golang-1.19-go, unpacked by .ci/setup-tests into .venv/pprof/pprof).

A real child grows a list of bytes objects in a named thread under `kvdoctor run --attribution`;
the profiles beside the trace must put the growing file:line first, labelled with the pid and the
thread, and `replay --pprof` must write the same profiles from the trace alone.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

PPROF = os.path.join(REPO, ".venv", "pprof", "pprof")
pytestmark = pytest.mark.skipif(not os.access(PPROF, os.X_OK), reason="no Go pprof tool (.ci/setup-tests unpacks it)")

GROWER = textwrap.dedent(
    """
    import threading, time
    held = []
    def back_up():
        while True:
            held.append(bytes(128 * 1024))   # GROWING LINE
            time.sleep(0.005)
    threading.Thread(target=back_up, name="storage-backup", daemon=True).start()
    time.sleep(4.5)
    """
)
GROWING_LINE = GROWER.splitlines().index(next(ln for ln in GROWER.splitlines() if "GROWING LINE" in ln)) + 1


def _pprof(*args: str) -> str:
    proc = subprocess.run([PPROF, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def grown(tmp_path_factory) -> tuple[str, str, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("pprof")
    script = folder / "grower.py"
    script.write_text(GROWER)
    trace = str(folder / "grow.kvtrace.json")
    env = dict(os.environ, KVDOCTOR_ATTRIBUTION_PERIOD_S="1.5", KVDOCTOR_ATTRIBUTION_WINDOW_S="1.0")
    command = ["run", "--attribution-engine", "tracemalloc", "--sample-interval", "0", "--trace", trace, "--", sys.executable, str(script)]
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor", *command], capture_output=True, text=True, env=env, cwd=str(folder), timeout=120
    )
    return trace, str(script), proc


def test_run_writes_each_window_beside_the_trace_and_pprof_puts_the_growing_line_first(grown):
    trace, script, proc = grown
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = trace[: -len(".json")] + ".pprof"
    profiles = sorted(os.listdir(folder))
    assert profiles and all(p.endswith(".pb.gz") for p in profiles), profiles
    assert f"{len(profiles)} attribution window(s) as pprof in {folder}" in proc.stderr
    first = os.path.join(folder, profiles[0])
    top = [ln for ln in _pprof("-top", "-lines", "-sample_index=space", first).splitlines() if "grower.py:" in ln or ".py:" in ln]
    assert top and f"grower.py:{GROWING_LINE}" in top[0], top[:3]
    raw = _pprof("-raw", first)
    assert "space/bytes objects/count" in raw
    labels = next(ln for ln in raw.splitlines() if "thread:[storage-backup]" in ln)
    assert re.search(r"pid:\[\d+\]", labels), labels
    assert f"{script}:{GROWING_LINE}" in raw


def test_replay_writes_the_same_profiles_from_the_trace(grown, tmp_path):
    trace, _, _ = grown
    out = str(tmp_path / "profiles")
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "replay", trace, "--pprof", out], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode in (0, 1), proc.stderr
    beside = sorted(os.listdir(trace[: -len(".json")] + ".pprof"))
    assert sorted(os.listdir(out)) == beside
    for name in beside:
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(trace[: -len(".json")] + ".pprof", name), "rb") as b:
            assert a.read() == b.read()


def test_a_folder_that_cannot_be_written_is_said_and_the_verdict_stands(grown, tmp_path):
    trace, _, _ = grown
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    args = [sys.executable, "-m", "kvdoctor", "replay", trace]
    plain = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120)
    proc = subprocess.run([*args, "--pprof", str(blocked)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == plain.returncode
    assert f"kvdoctor: warning: no pprof profiles written to {blocked}" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == plain.stdout
