"""The census asked for at shutdown (`kvdoctor/probe/base/shutdown.py`), between real processes: the
launcher's side waits for every registered live process and no longer than its deadline; a dead
process, or one that answered at its own exit, is not waited for."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from kvdoctor.probe.base.shutdown import ENV_RENDEZVOUS, Rendezvous

ENGINE_PROCESS = textwrap.dedent(
    """
    import sys, time
    from kvdoctor.probe.base.shutdown import Rendezvous
    r = Rendezvous.from_env()
    r.register()
    print("ready", flush=True)
    mode = sys.argv[1]
    if mode == "exit":
        r.answer("exit")
        sys.exit(0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if r.asked() and mode == "answer" and r.waited_s() >= 0.2:
            r.answer("shutdown", census_s=0.01)
        time.sleep(0.05)
    """
)


def _engine(directory: str, mode: str) -> subprocess.Popen:
    env = {**os.environ, ENV_RENDEZVOUS: directory}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_PROCESS, mode], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_the_launcher_waits_for_each_live_registered_process_and_no_longer(tmp_path):
    directory = str(tmp_path)
    answering, silent = _engine(directory, "answer"), _engine(directory, "silent")
    exited = _engine(directory, "exit")
    exited.wait(timeout=30)
    gone = _engine(directory, "silent")
    gone.kill()
    gone.wait(timeout=30)
    try:
        started = time.monotonic()
        outcome = Rendezvous(directory).ask_and_wait(wait_s=2.0)
        elapsed = time.monotonic() - started
    finally:
        for proc in (answering, silent):
            proc.kill()
            proc.wait(timeout=30)
    assert sorted(outcome["asked"]) == sorted([answering.pid, silent.pid, exited.pid, gone.pid])
    assert outcome["answered"][answering.pid]["census"] == "shutdown"
    assert outcome["answered"][exited.pid]["census"] == "exit"
    assert outcome["unanswered"] == [silent.pid]  # the killed one is not waited for
    assert 2.0 <= elapsed < 10.0  # the silent one held it to the deadline, not beyond


def test_without_the_silent_process_the_wait_ends_at_the_last_answer(tmp_path):
    directory = str(tmp_path)
    answering = _engine(directory, "answer")
    try:
        outcome = Rendezvous(directory).ask_and_wait(wait_s=20.0)
    finally:
        answering.kill()
        answering.wait(timeout=30)
    assert outcome["unanswered"] == [] and answering.pid in outcome["answered"]
    assert outcome["waited_s"] < 10.0


def test_no_directory_means_no_rendezvous_and_a_gone_directory_asks_no_one(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_RENDEZVOUS, raising=False)
    assert Rendezvous.from_env() is None
    monkeypatch.setenv(ENV_RENDEZVOUS, str(tmp_path / "missing"))
    assert Rendezvous.from_env() is None
    outcome = Rendezvous(str(tmp_path / "missing")).ask_and_wait(wait_s=5.0)
    assert outcome["asked"] == [] and outcome["waited_s"] == 0.0


def test_a_forked_child_is_not_registered_by_its_parent(tmp_path):
    rendezvous = Rendezvous(str(tmp_path))
    rendezvous.register()
    assert rendezvous.registered
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports what it believes, then leaves without cleanup
        os.close(read)
        os.write(write, b"1" if rendezvous.registered else b"0")
        os._exit(0)
    os.close(write)
    seen = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert seen == b"0"
    assert sorted(os.listdir(tmp_path)) == [f"ledger.{os.getpid()}"]
