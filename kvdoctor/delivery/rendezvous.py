"""The private directory `run` shares with its command's processes (KVDOCTOR_RENDEZVOUS: the census
asked for at shutdown, the writers that stopped). `run` removes it when the command ends; a run
that was SIGKILLed cannot, so each run first removes the directories of runs of this user that
are gone: the name carries the run's pid (`kvdoctor-run-<pid>-XXXXXX`). A GPU ledger's crash box
lives in /dev/shm (memory, not disk), named after its run's directory: those of runs that are gone
are removed with them."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable

PREFIX = "kvdoctor-run-"
_NAME = re.compile(rf"{PREFIX}(\d{{1,10}})-[A-Za-z0-9_]+")
MAX_SWEPT = 64  # directories looked at per run: a /tmp full of them costs one run little
SHM = "/dev/shm"
BOX_PREFIX = "kvdoctor-box-"  # kvdoctor/probe/ledgers/crash_box.py: kvdoctor-box-<run's directory>-<pid>-<ledger>
_BOX = re.compile(rf"{BOX_PREFIX}{PREFIX}(\d{{1,10}})-[A-Za-z0-9_]+-\d+-[0-9a-f]+")


def new_rendezvous() -> str:
    """A fresh 0700 directory in the system's temp dir, after removing those of dead runs."""
    sweep_dead_runs()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def sweep_dead_runs(directory: str | None = None, shm: str = SHM) -> list[str]:
    """Removes the rendezvous directories of this user's runs whose process is gone, and their crash
    boxes in `shm`; the paths removed. Only a real directory or file (not a link) owned by this user
    is ever removed."""
    boxes = _sweep(shm, BOX_PREFIX, _BOX, stat.S_ISREG, os.unlink)
    return boxes + _sweep(directory or tempfile.gettempdir(), PREFIX, _NAME, stat.S_ISDIR, lambda p: shutil.rmtree(p, ignore_errors=True))


def _sweep(
    where: str, prefix: str, name_of_run: re.Pattern[str], kind: Callable[[int], bool], remove: Callable[[str], object]
) -> list[str]:
    """The entries of `where` named after a run (its pid the pattern's first group) that is gone."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(where) if n.startswith(prefix)][:MAX_SWEPT]
    except OSError:
        return removed
    for name in names:
        match = name_of_run.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(where, name)
        try:
            st = os.lstat(path)
            if kind(st.st_mode) and st.st_uid == os.geteuid():
                remove(path)
                removed.append(path)
        except OSError:
            continue
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
