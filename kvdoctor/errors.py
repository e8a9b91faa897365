"""One error type the CLI maps to an exit code and one helpful line."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_UNUSABLE = 2


class KvdoctorError(Exception):
    """A failure a user can act on: `message` says what, `hint` says what to do."""

    exit_code = EXIT_UNUSABLE

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"kvdoctor: {self.message}" + (f" ({self.hint})" if self.hint else "")


class TraceError(KvdoctorError):
    """The trace file is missing, empty, corrupt or from a schema we cannot read."""
