"""`run` and `gate` say why a command's Python ran without the probe: a script replaced PYTHONPATH
(dropping the directory `run` put first there), or started its Python with an environment of its
own. The trace's end records each such process (`probe_path_lost`), and a gate with no probe
names the cause in its one line; a script that keeps $PYTHONPATH is recorded as nothing lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from kvdoctor.trace.schema import TRACE_END

WAIT_PY = '''"""Runs until kvdoctor's sampler has seen this process run this file (its counters name it)."""
import json, os, sys, time

def seen():
    with open(sys.argv[1]) as fh:
        for line in fh:
            if line.startswith("{") and str(os.getpid()) in line:
                event = json.loads(line.rstrip().rstrip(","))
                if event.get("pid") == os.getpid() and "wait.py" in str(event.get("args", {}).get("title", "")):
                    return True
    return False

deadline = time.monotonic() + 120
while not seen() and time.monotonic() < deadline:
    time.sleep(0.05)
'''
SCRIPTS = {
    "PYTHONPATH": 'export PYTHONPATH="$(dirname "$0")"\n"$PY" "$(dirname "$0")/wait.py" "$KVDOCTOR_TRACE"\n',
    "environment": 'env -i PATH="$PATH" "$PY" "$(dirname "$0")/wait.py" "$KVDOCTOR_TRACE"\n',
    "": 'export PYTHONPATH="$(dirname "$0"):$PYTHONPATH"\n"$PY" "$(dirname "$0")/wait.py" "$KVDOCTOR_TRACE"\n',
}
CAUSES = {
    "PYTHONPATH": "): the process's PYTHONPATH lost kvdoctor's directory: keep $PYTHONPATH in it",
    "environment": "): the process's environment lost kvdoctor's variables (KVDOCTOR_TRACE)",
}


def _end(trace: str) -> dict:
    with open(trace) as fh:
        events = [json.loads(line.rstrip().rstrip(",")) for line in fh if line.startswith("{")]
    (end,) = [e for e in events if e["name"] == TRACE_END]
    return end["args"]


@pytest.mark.parametrize("lost", list(SCRIPTS))
def test_a_gate_names_the_python_that_lost_the_probes_way_in(tmp_path, lost):
    (tmp_path / "wait.py").write_text(WAIT_PY)
    (tmp_path / "bench.sh").write_text("#!/bin/sh\n" + SCRIPTS[lost])
    (tmp_path / "bench.sh").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
    env.update({"PY": sys.executable, "PYTHONPATH": REPO})
    trace = str(tmp_path / "t.kvtrace.json")
    gate = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "gate", "--trace", trace, "--", "./bench.sh"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert gate.returncode == 1, gate.stdout + gate.stderr[-2000:]
    (line,) = [line for line in gate.stdout.splitlines() if "probe-reported" in line]
    recorded = _end(trace).get("probe_path_lost", [])
    if not lost:
        assert recorded == [] and line.endswith("did the server start, and under kvdoctor?"), (recorded, line)
        return
    (process,) = recorded
    # the record keeps 120 characters of the title, and the test's folder may be deeper than that
    assert process["lost"] == lost and process["title"] == f"{sys.executable} ./wait.py {trace}"[:120], process
    assert line.startswith(f"  FAIL  probe-reported: no probe reported from an engine: pid {process['pid']} (python ./wait.py "), line
    assert CAUSES[lost] in line, line
