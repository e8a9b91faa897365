"""`run` on a full filesystem (#27 item 9): the trace's directory is a 200 KiB tmpfs that the
command fills; the probe and the sampler meet ENOSPC and the trace's end cannot be written.
`run` used to end in `internal error: OSError [Errno 28]` with exit 2; it exits with the
command's own status and says in one line what the trace lacks.

A real filesystem that fills up, so this needs root to mount it; elsewhere it is skipped, saying so.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

LEAK = "from kvdoctor.demo.workload import WorkloadConfig, run_workload; run_workload(WorkloadConfig(fault='leak', turns=2))"


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a 200 KiB tmpfs needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_run_on_a_full_disk_exits_with_the_commands_status(small_tmpfs):
    """The command fills the filesystem, then runs the demo workload under the probe (about 30 KB
    of events, so the trace's last page fills and its end cannot be written), then exits 3."""
    trace = small_tmpfs / "run.kvtrace.json"
    script = f'head -c 1M /dev/zero > {small_tmpfs}/filler; {sys.executable} -W ignore -c "{LEAK}"; exit 3'
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "run", "--trace", str(trace), "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("kvdoctor: warning:")]
    assert len(warnings) == 1 and f"the trace {trace} is incomplete" in warnings[0], proc.stderr[-3000:]
    assert "No space left on device" in warnings[0]
    assert f"kvdoctor: trace {trace}" in proc.stderr  # what it holds is still analysed
