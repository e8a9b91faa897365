"""The private directory `run` shares with its command's processes (KVDOCTOR_RENDEZVOUS: the census
asked for at shutdown, the writers that stopped). `run` removes it when the command ends; a run
that was SIGKILLed cannot, so each run first removes the directories of runs of this user that
are gone: the name carries the run's pid (`kvdoctor-run-<pid>-XXXXXX`)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile

PREFIX = "kvdoctor-run-"
_NAME = re.compile(rf"{PREFIX}(\d{{1,10}})-[A-Za-z0-9_]+")
MAX_SWEPT = 64  # directories looked at per run: a /tmp full of them costs one run little


def new_rendezvous() -> str:
    """A fresh 0700 directory in the system's temp dir, after removing those of dead runs."""
    sweep_dead_runs()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def sweep_dead_runs(directory: str | None = None) -> list[str]:
    """Removes the rendezvous directories of this user's runs whose process is gone; the paths
    removed. Only a real directory (not a link) owned by this user is ever removed."""
    directory = directory or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX)][:MAX_SWEPT]
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # never a run's pid: left alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process (EPERM): alive
    return True
