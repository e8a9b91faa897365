"""`kvdoctor fixes`: the optional fixes, what each changes, and its risk (all are off by default)."""

from __future__ import annotations

from kvdoctor.errors import EXIT_OK


def list_fixes() -> int:
    from kvdoctor.probe.fixes import FIXES

    for fix in FIXES.values():
        print(f"{fix.name}\n  fixes:   {fix.fixes}\n  changes: {fix.changes}\n  risk:    {fix.risk}\n")
    return EXIT_OK
