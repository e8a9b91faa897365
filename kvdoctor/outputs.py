"""Everything a command writes for a person or a file, made safe in one place.

- Text that came from a trace (request ids a client chose, process titles) can carry control
  bytes: an ESC clears a terminal, a NUL makes JUnit XML ill-formed. `printable` escapes them.
- A path a user names may be their own file or a device: `claim_output` refuses to replace an
  existing file unless told (`--force`), and never replaces anything but a regular file.
- Reports and exports hold command lines and request ids: they are written 0600, like traces,
  through a temporary name, so a failed write leaves no half file.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import tempfile

from kvdoctor.errors import KvdoctorError

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def printable(text: str) -> str:
    """`text` with control characters (other than newline and tab) written as \\xNN, and lone
    surrogates (from a crafted trace) as \\udNNN: safe for a terminal and for any encoding."""
    escaped = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return escaped.encode("utf-8", "backslashreplace").decode("utf-8")


def xml_text(text: str) -> str:
    """`printable` text that XML 1.0 also accepts (no tab-less control characters at all)."""
    return _XML_INVALID.sub(lambda m: f"\\x{ord(m.group()):02x}", printable(text))


def claim_output(path: str, *, force: bool = False, what: str = "file") -> str:
    """The absolute path, once it is safe to write there: not an existing non-regular file (a
    device, a directory, a socket), and not an existing file unless `force`."""
    resolved = os.path.abspath(path)
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        return resolved
    except OSError as exc:
        raise KvdoctorError(f"cannot write the {what} {resolved}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise KvdoctorError(f"{resolved} is {kind}: kvdoctor will not write the {what} there", "name a new file")
    if not force:
        raise KvdoctorError(f"{resolved} exists: kvdoctor will not replace it", "name a new file, or pass --force to replace it")
    return resolved


def write_private(path: str, text: str, *, force: bool = False, what: str = "report") -> str:
    """Writes `text` to `path` (0600), replacing it only as `claim_output` allows; returns the path."""
    resolved = claim_output(path, force=force, what=what)
    directory = os.path.dirname(resolved) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".kvdoctor-", dir=directory)
        try:
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
    try:
        print(printable(text))
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail again
        except OSError:
            pass
