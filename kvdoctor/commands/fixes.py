"""`kvdoctor fixes`: the optional fixes, what each changes, and its risk (all are off by default)."""

from __future__ import annotations

from kvdoctor.errors import EXIT_OK
from kvdoctor.outputs import to_stdout


def list_fixes() -> int:
    from kvdoctor.probe.base.fixes import FIXES

    to_stdout("\n".join(f"{fix.name}\n  fixes:   {fix.fixes}\n  changes: {fix.changes}\n  risk:    {fix.risk}\n" for fix in FIXES.values()))
    return EXIT_OK
