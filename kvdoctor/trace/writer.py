"""Writing traces: appended in whole batches, so a crash loses at most the batch in flight.

Imported by the in-process probe: standard library (and orjson, where installed) only.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from typing import Any

from kvdoctor.trace.codec import dumps
from kvdoctor.trace.schema import TRACE_END, Event

# Command lines and process titles go into traces and reports: values that look like secrets
# (`--api-key X`, `--hf-token=X`, `OPENAI_API_KEY=X`, `sk-...`, `hf_...`) are written as ***.
_SECRET_WORD = r"(?:key|token|secret|password|passwd|credential)(?![a-z])"
_SECRET_FLAG = re.compile(r"(--?[\w.-]*" + _SECRET_WORD + r"[\w.-]*)(=|\s+)(\S+)", re.IGNORECASE)
_SECRET_ASSIGN = re.compile(r"\b([A-Za-z_]*(?:KEY|TOKEN|SECRET|PASSWORD)[A-Za-z_]*)=(\S+)")
_SECRET_VALUE = re.compile(r"\b(sk-|hf_)[A-Za-z0-9_-]{12,}")
REDACTED = "***"


def redact(text: str) -> str:
    """`text` (a command line, a process title) with secret-looking values replaced by ***."""
    text = _SECRET_FLAG.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _SECRET_ASSIGN.sub(lambda m: f"{m.group(1)}={REDACTED}", text)
    return _SECRET_VALUE.sub(lambda m: f"{m.group(1)}{REDACTED}", text)


_SECRET_FLAG_ALONE = re.compile(r"--?[\w.-]*" + _SECRET_WORD + r"[\w.-]*", re.IGNORECASE)


def redact_args(args: list[str]) -> list[str]:
    """A command's argument list with secret values replaced (a flag's value may be the next word)."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        out.append(REDACTED if hide_next else redact(arg))
        hide_next = not hide_next and bool(_SECRET_FLAG_ALONE.fullmatch(arg))
    return out


_APPEND = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK


def open_for_append(path: str, *, opening: bytes = b"") -> int:
    """A descriptor appending to the regular file at `path`, created 0600 (starting with `opening`)
    where there is none. Never through a symbolic link, and never a device, FIFO or socket: the
    open does not wait (a FIFO with no reader would hold a writer thread, and the process's exit,
    forever), and anything but a regular file is refused with OSError."""
    try:
        fd = os.open(path, _APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        created = True
    except FileExistsError:
        fd = os.open(path, _APPEND)
        created = False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
        if created and opening:
            os.write(fd, opening)
    except BaseException:
        os.close(fd)
        raise
    return fd


def now_us() -> float:
    return time.time() * 1e6


def encode_event(event: Event | dict[str, Any]) -> bytes:
    raw = event.to_json_dict() if isinstance(event, Event) else event
    return dumps(raw) + b",\n"


class TraceWriter:
    """Appends events to a trace file. Safe to share between processes (O_APPEND, whole batches).

    The first writer to create the file writes the opening bracket. `write_batch` issues one
    `write(2)` per batch, so a crash loses at most the batch in flight, never earlier lines.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._fd: int | None = open_for_append(path, opening=b"[\n")

    def write_batch(self, events: list[Event | dict[str, Any]]) -> int:
        if self._fd is None or not events:
            return 0
        payload = b"".join(encode_event(e) for e in events)
        view = memoryview(payload)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        return len(payload)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def finish_trace(path: str, pid: int, extra: dict[str, Any] | None = None) -> None:
    """Closes the JSON array so the file is strict JSON too (only when every writer is done);
    `extra` joins the end event (the command's exit status, for `run`)."""
    end = Event(ph="M", name=TRACE_END, pid=pid, args={"ended_at_us": now_us(), **(extra or {})}).to_json_dict()
    with open(open_for_append(path, opening=b"[\n"), "ab") as fh:
        fh.write(dumps(end) + b"\n]\n")
