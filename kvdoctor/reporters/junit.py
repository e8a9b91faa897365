"""JUnit XML for a gate result: one testcase per check, so CI systems show each budget by name."""

from __future__ import annotations

import os
from xml.sax.saxutils import escape, quoteattr

from kvdoctor.analysis.gate import GateResult

SUITE = "kvdoctor-gate"


def render_junit(result: GateResult) -> str:
    """A check that failed is a `failure`; a gate that could not judge is one `error`."""
    failures = len(result.failed) if result.judged else 0
    errors = 0 if result.judged else 1
    tests = len(result.checks) + errors
    lines = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<testsuites name="kvdoctor" tests="{tests}" failures="{failures}" errors="{errors}">',
        f'  <testsuite name="{SUITE}" tests="{tests}" failures="{failures}" errors="{errors}" skipped="0">',
    ]
    for check in result.checks:
        lines.append(f'    <testcase classname="{SUITE}" name={quoteattr(check.name)}>')
        if check.passed:
            lines.append(f"      <system-out>{escape(check.detail)}</system-out>")
        else:
            lines.append(f'      <failure message={quoteattr(check.detail)} type="budget">{escape(check.detail)}</failure>')
        lines.append("    </testcase>")
    if not result.judged:
        lines.append(f'    <testcase classname="{SUITE}" name="judge">')
        lines.append(f'      <error message={quoteattr(result.reason)} type="could-not-judge">{escape(result.reason)}</error>')
        lines.append("    </testcase>")
    lines += ["  </testsuite>", "</testsuites>", ""]
    return "\n".join(lines)


def write_junit(result: GateResult, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_junit(result))
