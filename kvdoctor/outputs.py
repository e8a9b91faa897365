"""Everything a command writes for a person or a file, made safe in one place.

- Text that came from a trace (request ids a client chose, process titles, call sites) can carry
  control bytes: an ESC clears a terminal, a NUL makes JUnit XML ill-formed, a newline forges a
  report line or a GitHub `::error` command, U+202E shows a line reversed. `printable` escapes
  them in a whole report, `one_line` also the newlines and tabs of one field of it.
- stdout may be a pipe whose reader goes away (`| head`) or a terminal that takes only ASCII: the
  command still ends with its own exit code (`to_stdout`, `reader_may_leave`, `tolerant_streams`).
- A path a user names may be their own file or a device: `claim_output` refuses to replace an
  existing file unless told (`--force`), never replaces anything but a regular file or a link
  (the link itself, never what it points to), and never writes over one of the command's inputs.
- `-` and `/dev/stdout` name standard output (`names_stdout`), not a file to claim.
- A CSV cell a spreadsheet would run as a formula is written with a leading apostrophe
  (`spreadsheet_cell`): a request id or allocator name is data, never `=HYPERLINK(...)`.
- Reports and exports hold command lines and request ids: they are written 0600, like traces,
  through a temporary name, so a failed write leaves no half file.
- JSON is strict (`strict`): a number that is not finite (a NaN or an infinity a damaged trace
  carried into the evidence) is written as null, since strict parsers (JavaScript's, jq's) reject
  `NaN`/`Infinity`; nesting deeper than MAX_DEPTH is said, not written.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

from kvdoctor.errors import KvdoctorError

# Bidirectional controls (embeddings, overrides, isolates, marks) and the Unicode line and
# paragraph separators: none is ever part of kvdoctor's own output.
_INVISIBLE = "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_INVISIBLE}]")
_CONTROL_OR_BREAK = re.compile(f"[\x00-\x1f\x7f-\x9f{_INVISIBLE}]")
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with control characters (other than newline and tab) and bidirectional controls
    written as \\xNN or \\uNNNN, and lone surrogates (from a crafted trace) as \\udNNN: safe
    for a terminal and for any encoding. For a whole report, whose lines are kvdoctor's own."""
    escaped = _CONTROL.sub(_escaped, text)
    return escaped.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line(text: object) -> str:
    """`printable`, with newlines, carriage returns and tabs escaped too: one field from a trace
    (a request id, a process title, a call site, a finding's sentence) that can never start a
    line of its own in a report, a gate verdict or a CI log."""
    escaped = _CONTROL_OR_BREAK.sub(_escaped, str(text))
    return escaped.encode("utf-8", "backslashreplace").decode("utf-8")


def xml_text(text: str) -> str:
    """`one_line` text, which XML 1.0 also accepts: a JUnit name or message is one line."""
    return _XML_INVALID.sub(_escaped, one_line(text))


STDOUT_NAMES = ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def names_stdout(path: str) -> bool:
    """`-`, or a name the system gives this process's standard output: the output goes there, and
    is not refused as a file that exists (a pipe or a terminal behind it is no file to claim)."""
    return path == "-" or os.path.normpath(path) in STDOUT_NAMES


def spreadsheet_cell(text: str) -> str:
    """`text` as a spreadsheet shows it and never runs it: a cell beginning with = + - @, a tab or
    a carriage return gets a leading apostrophe (OWASP's CSV injection advice); control bytes are
    escaped as `printable` does (a bare carriage return would split the row)."""
    return printable("'" + text if text.startswith(_FORMULA_START) else text)


def same_file(first: str, second: str) -> bool:
    """Whether two paths name one file, however spelled (relative, `..`, a link, a hard link)."""
    try:
        return os.path.samefile(first, second)
    except OSError:
        return os.path.realpath(first) == os.path.realpath(second)


def claim_output(path: str, *, force: bool = False, what: str = "file", inputs: Sequence[str | None] = ()) -> str:
    """The absolute path, once it is safe to write there: none of `inputs` (the files the command
    reads), not an existing non-regular file (a device, a FIFO, a directory, a socket), and not an
    existing file or symbolic link unless `force` (then the link itself is replaced, never what it
    points to)."""
    resolved = os.path.abspath(path)
    for source in inputs:
        if source and same_file(resolved, source):
            raise KvdoctorError(
                f"the {what} {resolved} would overwrite the input {os.path.abspath(source)}: kvdoctor will not write over what it reads",
                "name another file",
            )
    try:
        st = os.lstat(resolved)
    except FileNotFoundError:
        return resolved
    except OSError as exc:
        raise KvdoctorError(f"cannot write the {what} {resolved}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        if not force:
            raise KvdoctorError(
                f"{resolved} is a symbolic link: kvdoctor will not write through it",
                "name a new file, or pass --force to replace the link itself (never what it points to)",
            )
        return resolved
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise KvdoctorError(f"{resolved} is {kind}: kvdoctor will not write the {what} there", "name a new file")
    if not force:
        raise KvdoctorError(f"{resolved} exists: kvdoctor will not replace it", "name a new file, or pass --force to replace it")
    return resolved


def remove_claimed(resolved: str) -> None:
    """Removes what `claim_output` let a command replace (a regular file, or a link itself), so the
    file is created afresh, 0600, by its writer."""
    if os.path.lexists(resolved):
        os.remove(resolved)


def claim_folder(path: str, *, what: str = "folder") -> str:
    """The absolute path of a directory kvdoctor writes its own files into (pprof profiles): made
    0700 when missing; an existing one must be a directory itself (not a link to one), this user's,
    and writable by no one else, so nobody else can put a file or a link where kvdoctor writes."""
    resolved = os.path.abspath(path)
    try:
        os.mkdir(resolved, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise KvdoctorError(f"cannot make the {what} {resolved}: {exc.strerror or exc}", "name a writable place") from None
    try:
        st = os.lstat(resolved)
    except OSError as exc:
        raise KvdoctorError(f"cannot write into the {what} {resolved}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise KvdoctorError(f"{resolved} is {kind}: kvdoctor will not write the {what} there", "remove it, or name another place")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        whose = "another user's" if st.st_uid != os.geteuid() else "writable by others"
        raise KvdoctorError(f"{resolved} is {whose}: kvdoctor will not write the {what} there", "remove it, or name another place")
    return resolved


def write_private(path: str, text: str | bytes, *, force: bool = False, what: str = "report", inputs: Sequence[str | None] = ()) -> str:
    """Writes `text` (or bytes) to `path` (0600), replacing it only as `claim_output` allows; returns the path."""
    resolved = claim_output(path, force=force, what=what, inputs=inputs)
    directory = os.path.dirname(resolved) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".kvdoctor-", dir=directory)
        try:
            if isinstance(text, bytes):
                with os.fdopen(fd, "wb") as raw:
                    raw.write(text)
            else:
                with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
                    fh.write(text)
            os.chmod(temporary, 0o600)
            os.replace(temporary, resolved)
        except BaseException:
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
    except OSError as exc:
        raise KvdoctorError(f"cannot write the {what} {resolved}: {exc.strerror or exc}", "name a writable place") from None
    return resolved


def to_stdout(text: str) -> None:
    """Prints a command's main output; a reader that went away (`| head`) ends it quietly, and the
    command still returns its own exit code."""
    with reader_may_leave():
        print(printable(text))
        sys.stdout.flush()


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Writes to stdout inside it end quietly when the reader went away: stdout then goes to
    /dev/null, so neither a later write nor the interpreter's last flush fails again, and the
    command goes on to return its own exit code (a gate's FAIL stays 1)."""
    try:
        yield
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except OSError:
            pass


def tolerant_streams() -> None:
    """stdout and stderr write what their encoding cannot hold as backslash escapes (`≥` as
    \\u2265 under PYTHONIOENCODING=ascii or a C locale), never an error mid-report; and a stderr
    whose reader went away (`2>&1 | head -c1`) takes later lines quietly, so the command still
    ends with its own exit code (`run`'s is its command's)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass
    if not isinstance(sys.stderr, _ReaderMayLeave) and sys.stderr is not None:
        sys.stderr = _ReaderMayLeave(sys.stderr)


class _ReaderMayLeave:
    """A text stream (stderr) whose writes end quietly once its reader went away: the descriptor
    then points at /dev/null, so neither a later line nor the interpreter's last flush fails."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._reader_left()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._reader_left()

    def _reader_left(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


MAX_DEPTH = 32  # levels of nesting a report writes; a crafted trace's deeper evidence is said, not written


def strict(value: Any, depth: int = 0) -> Any:
    """`value` with every non-finite float as None, through dicts, lists and tuples, and what is
    nested deeper than MAX_DEPTH as a string saying so (a 900-deep field from a trace made the
    JSON writer raise RecursionError)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (dict, list, tuple)) and depth >= MAX_DEPTH:
        return f"(nested deeper than {MAX_DEPTH} levels: not written)"
    if isinstance(value, dict):
        return {key: strict(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item, depth + 1) for item in value]
    return value
