"""pprof profiles go through the one claiming rule every kvdoctor output follows (kvdoctor/outputs.py):
a link at a profile's path is never followed, a file there is replaced only with `--force`, a FIFO
never (the command used to hang on it), the trace being replayed is never written over, and a
folder another user made, or anyone may write, is never written into. A profile is 0600.

`replay TRACE --pprof FOLDER` is run for real on a small trace with one attribution window; `run`
writes its `<trace>.pprof/` through the same function with `run`'s `--force`.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from conftest import REPO

from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, finish_trace

PROFILE = "pid7-window0.pb.gz"
VICTIM_TEXT = "someone else's file\n"


def window_trace(path) -> str:
    """A finished trace of pid 7 with one attribution window whose one site grew."""
    writer = TraceWriter(str(path))
    header = schema.header_event(pid=7, engine="", engine_version="", process_title="python grow.py", extra={"command": ["python"]})
    header.name = schema.RUN_HEADER
    window = schema.Event(
        ph="i",
        name=schema.HOST_GROWTH_SITES,
        pid=7,
        ts=1_700_000_000_000_000.0,
        args={"window_index": 0, "window_s": 1.0, "top_sites": [{"file": "grow.py", "line": 3, "size_diff_bytes": 4096, "count_diff": 2}]},
    )
    writer.write_batch([header, window])
    writer.close()
    finish_trace(str(path), 7, {"command_exit": 0})
    return str(path)


def replay_pprof(trace: str, folder, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "replay", trace, "--pprof", str(folder), *extra],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def refused(proc: subprocess.CompletedProcess, folder) -> str:
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(f"kvdoctor: warning: no pprof profiles written to {folder}")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture
def trace(tmp_path) -> str:
    return window_trace(tmp_path / "grow.kvtrace.json")


def test_a_profile_is_written_0600(trace, tmp_path):
    folder = tmp_path / "profiles"
    proc = replay_pprof(trace, folder)
    assert "1 attribution window(s) as pprof" in proc.stderr, proc.stderr
    assert stat.S_IMODE(os.stat(folder / PROFILE).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


def test_a_link_at_a_profiles_path_is_never_followed(trace, tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    os.symlink(victim, folder / PROFILE)
    assert "symbolic link" in refused(replay_pprof(trace, folder), folder)
    assert victim.read_text() == VICTIM_TEXT
    replay_pprof(trace, folder, "--force")  # the link itself is replaced, never what it points to
    assert victim.read_text() == VICTIM_TEXT
    assert not os.path.islink(folder / PROFILE) and (folder / PROFILE).read_bytes()[:2] == b"\x1f\x8b"


def test_an_existing_profile_is_replaced_only_with_force(trace, tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir(mode=0o700)
    (folder / PROFILE).write_text(VICTIM_TEXT)
    assert "exists" in refused(replay_pprof(trace, folder), folder)
    assert (folder / PROFILE).read_text() == VICTIM_TEXT
    replay_pprof(trace, folder, "--force")
    assert (folder / PROFILE).read_bytes()[:2] == b"\x1f\x8b"


def test_a_fifo_at_a_profiles_path_never_hangs_even_with_force(trace, tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir(mode=0o700)
    os.mkfifo(folder / PROFILE)
    assert "not a regular file" in refused(replay_pprof(trace, folder, "--force"), folder)  # the timeout fails a hang
    assert stat.S_ISFIFO(os.lstat(folder / PROFILE).st_mode)


def test_the_trace_being_replayed_is_never_written_over(tmp_path):
    folder = tmp_path / "profiles"
    folder.mkdir(mode=0o700)
    trace = window_trace(folder / PROFILE)  # the trace has the name its profile would get
    before = open(trace, "rb").read()
    assert "would overwrite the input" in refused(replay_pprof(trace, folder, "--force"), folder)
    assert open(trace, "rb").read() == before


def test_a_folder_anyone_may_write_is_never_written_into(trace, tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o777)
    assert "writable by others" in refused(replay_pprof(trace, folder, "--force"), folder)
    assert os.listdir(folder) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user takes root")
def test_a_folder_another_user_made_is_never_written_into(trace, tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o755)
    os.chown(folder, 65534, 65534)
    assert "another user's" in refused(replay_pprof(trace, folder, "--force"), folder)
    assert os.listdir(folder) == []


def test_a_link_to_a_folder_is_never_written_through(trace, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "profiles")
    assert "symbolic link" in refused(replay_pprof(trace, tmp_path / "profiles", "--force"), tmp_path / "profiles")
    assert os.listdir(real) == []
