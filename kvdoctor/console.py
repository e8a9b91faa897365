"""The `kvdoctor` script and `python -m kvdoctor`: the command line, with a Ctrl-C in its first
moments (while its modules are still being imported, ~0.2 s) ending as one later does, with
`kvdoctor: interrupted` and exit 130, never a traceback. Nothing is imported here before it."""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130


def main() -> None:
    try:
        from kvdoctor.cli import app

        app(prog_name="kvdoctor")
    except KeyboardInterrupt:  # before a command's own guard was in place, or after it
        try:
            sys.stderr.write("kvdoctor: interrupted\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        raise SystemExit(EXIT_INTERRUPTED) from None
