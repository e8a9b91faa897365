"""`kvdoctor run` against what its command and its readers do to it (issue 52): a stderr reader
that goes away, a rendezvous file the command names itself. `run` is started for real."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

from conftest import REPO

from kvdoctor.trace import schema


def kv_run(tmp_path, *command: str, stderr=subprocess.PIPE, timeout: float = 120) -> subprocess.CompletedProcess:
    trace = str(tmp_path / "t.kvtrace.json")
    return subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "run", "--sample-interval", "0", "--trace", trace, "--", *command],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def _run_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "kvdoctor-run-*")))


# ---------------------------------------------------------------- item 10: a stderr reader that goes away


def test_a_stderr_reader_that_went_away_leaves_runs_exit_code(tmp_path):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before run writes its first line: every write meets EPIPE
    try:
        proc = kv_run(tmp_path, "sh", "-c", "exit 7", stderr=write)
    finally:
        os.close(write)
    assert proc.returncode == 7  # before: 1 (the summary's EPIPE became an internal error)


# ---------------------------------------------------------------- item 11: rendezvous names the command chose


def test_rendezvous_files_with_non_ascii_digits_do_not_crash_run(tmp_path):
    before = _run_dirs()
    script = 'touch "$KVDOCTOR_RENDEZVOUS/writer-stopped.²" "$KVDOCTOR_RENDEZVOUS/ledger.²" "$KVDOCTOR_RENDEZVOUS/writer-stopped.٣"; exit 3'
    proc = kv_run(tmp_path, "sh", "-c", script)
    assert proc.returncode == 3, proc.stderr[-2000:]  # before: 2, internal error: ValueError
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    with open(tmp_path / "t.kvtrace.json") as fh:
        trace = json.load(fh)
    ends = [e for e in trace if e.get("name") == schema.TRACE_END]
    assert len(ends) == 1 and ends[0]["args"]["command_exit"] == 3
    assert _run_dirs() - before == set()  # the rendezvous directory is gone
