"""The trace an attached probe writes: claimed and created by kvdoctor before anything is injected.

The probe inside the target only ever appends to a regular file that is already there (see
kvdoctor.trace.writer.open_for_append), so a `--trace` naming a device, a FIFO or a link is refused
here, in one line, and never reaches the server, whose writer thread must never block on a FIFO
(a blocked writer keeps the server from exiting).
"""

from __future__ import annotations

import os
import stat

from kvdoctor.errors import KvdoctorError
from kvdoctor.outputs import claim_output, remove_claimed

OPENING = b"[\n"  # what a trace holds before its first event


def create_probe_trace(path: str, *, force: bool, owner_uid: int) -> str:
    """Claims `path` as `run` claims its trace, creates it (0600, owned by the target's user so a
    server that root attached to can append to it) and returns its absolute path."""
    resolved = claim_output(path, force=force, what="trace")
    try:
        remove_claimed(resolved)
        os.makedirs(os.path.dirname(resolved), exist_ok=True)
        fd = os.open(resolved, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, OPENING)
            if owner_uid != os.geteuid():
                os.fchown(fd, owner_uid, -1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise KvdoctorError(f"cannot write the trace {resolved}: {exc.strerror or exc}", "pass --trace to a writable place") from None
    return resolved


def drop_unwritten_trace(path: str) -> None:
    """Removes the trace `create_probe_trace` made if no probe wrote to it (the attach failed, or
    the probe was already on and writes elsewhere); a trace holding events is never removed."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size == len(OPENING):
            os.remove(path)
    except OSError:
        pass
