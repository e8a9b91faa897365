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

# Command lines and process titles go into traces, reports and metrics: values that look like
# secrets are written as ***. A flag naming one (`--api-key X`, `--hf-token=X`, `--auth X`, `-k X`),
# a key naming one in `K=V`, `K: V` or JSON/dict form (`OPENAI_API_KEY=X`, `Authorization: Bearer X`,
# `{"token": "X"}`), a URL's password (`https://user:X@host`), a bearer token, and the shapes of
# well-known tokens (`sk-...`, `hf_...`, `ghp_...`). A word such as `tokens` or `author` is no secret.
# Every pattern runs in time linear in the text (the probe redacts its process title as it changes):
# a name starts only where no name character precedes it, is taken whole (`(?=(?P<n>...))(?P=n)`,
# an atomic group), and quoted values are bounded.
_SECRET_WORD = r"(?:key|token|secret|password|passwd|passphrase|credentials?|auth|authorization|cookie|bearer)(?![a-z])"
_SECRET_NAME = r"(?=[\w.-]*?" + _SECRET_WORD + r")(?=(?P<name>[\w.-]+))(?P=name)"  # a whole name holding the word
_SECRET_FLAG = re.compile(r"(?<![\w.-])(?P<flag>--?" + _SECRET_NAME + r"|-k)(?P<sep>=|\s+)\S+", re.I)
_AUTH_SCHEME = r"(?:bearer|basic|token|digest|negotiate)"
_SECRET_PAIR = re.compile(
    r"""(?<![\w.-])(?P<quote>["']?)(?<![\w.-])"""
    + _SECRET_NAME
    + r"""(?P=quote)(?P<sep>\s*[:=]\s*)(?P<scheme>"""
    + _AUTH_SCHEME
    + r"""\s+)?"""
    r"""(?P<value>"[^"]{0,512}"|'[^']{0,512}'|[^\s,;&}\]"']+)""",
    re.I,
)
_URL_PASSWORD = re.compile(r"(?<![\w+.-])(?P<user>[a-z][a-z0-9+.-]{0,31}://[^\s/:@]{0,256}):[^\s/@]{1,512}@", re.I)
_BEARER = re.compile(r"\b(?P<scheme>bearer\s+)[^\s\"',;]+", re.I)
_SECRET_VALUE = re.compile(r"\b(?P<prefix>sk-|hf_|ghp_|gho_|ghs_|github_pat_|glpat-|xox[abprs]-)[A-Za-z0-9_-]{12,}")
REDACTED = "***"


def _hidden_pair(m: re.Match[str]) -> str:
    value = m.group("value")
    shown = value[0] + REDACTED + value[0] if value[0] in "'\"" else REDACTED
    return f"{m.group('quote')}{m.group('name')}{m.group('quote')}{m.group('sep')}{m.group('scheme') or ''}{shown}"


def redact(text: str) -> str:
    """`text` (a command line, a process title) with secret-looking values replaced by ***."""
    text = _SECRET_FLAG.sub(lambda m: f"{m.group('flag')}{m.group('sep')}{REDACTED}", text)
    text = _SECRET_PAIR.sub(_hidden_pair, text)
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('user')}:{REDACTED}@", text)
    text = _BEARER.sub(lambda m: f"{m.group('scheme')}{REDACTED}", text)
    return _SECRET_VALUE.sub(lambda m: f"{m.group('prefix')}{REDACTED}", text)


_NAME = re.compile(r"[\w.-]+")
_NAMES_SECRET = re.compile(_SECRET_WORD, re.I)
_SCHEME_ALONE = re.compile(_AUTH_SCHEME, re.I)


def _value_is_next(arg: str) -> bool:
    """Whether `arg`'s value is the next argument: a secret flag (`--api-key`, `-k`), a header
    name alone (`Authorization:`), or `Bearer`."""
    if arg.lower() in ("-k", "bearer"):
        return True
    name = arg[2:] if arg.startswith("--") else arg[1:] if arg.startswith("-") else arg[:-1] if arg.endswith(":") else ""
    return _NAME.fullmatch(name) is not None and _NAMES_SECRET.search(name) is not None


def redact_args(args: list[str]) -> list[str]:
    """A command's argument list with secret values replaced (a flag's value may be the next word,
    a header's the word after its scheme: `-H Authorization: Bearer X`)."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next and _SCHEME_ALONE.fullmatch(arg):
            out.append(arg)  # `Bearer` of `Authorization: Bearer X`: the value is the next word
            continue
        out.append(REDACTED if hide_next else redact(arg))
        hide_next = not hide_next and _value_is_next(arg)
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
