"""JUnit XML for a gate result: one testcase per check, so CI systems show each budget by name."""

from __future__ import annotations

from xml.sax.saxutils import escape as _escape
from xml.sax.saxutils import quoteattr as _quoteattr

from kvdoctor.analysis.gate_result import GateResult
from kvdoctor.outputs import xml_text

SUITE = "kvdoctor-gate"


def escape(text: str) -> str:
    """XML text from anything a trace carried (a client's request id may hold control bytes)."""
    return _escape(xml_text(text))


def quoteattr(text: str) -> str:
    return _quoteattr(xml_text(text))


def render_junit(result: GateResult) -> str:
    """A check that failed is a `failure`; one with nothing to judge, or a gate that could not
    judge, is an `error`."""
    failures = len(result.failed)
    errors = len(result.unjudged) + (0 if result.judged else 1)
    tests = len(result.checks) + (0 if result.judged else 1)
    lines = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<testsuites name="kvdoctor" tests="{tests}" failures="{failures}" errors="{errors}">',
        f'  <testsuite name="{SUITE}" tests="{tests}" failures="{failures}" errors="{errors}" skipped="{len(result.turned_off) + len(result.not_applicable)}">',
    ]
    for check in result.checks:
        lines.append(f'    <testcase classname="{SUITE}" name={quoteattr(check.name)}>')
        if check.off or not check.applicable:
            lines.append(f"      <skipped message={quoteattr(check.detail)} />")
        elif not check.judged:
            lines.append(f'      <error message={quoteattr(check.detail)} type="could-not-judge">{escape(check.detail)}</error>')
        elif check.passed:
            lines.append(f"      <system-out>{'warning: ' if check.warning else ''}{escape(check.detail)}</system-out>")
        else:
            lines.append(f'      <failure message={quoteattr(check.detail)} type="budget">{escape(check.detail)}</failure>')
        lines.append("    </testcase>")
    if not result.judged:
        lines.append(f'    <testcase classname="{SUITE}" name="judge">')
        lines.append(f'      <error message={quoteattr(result.reason)} type="could-not-judge">{escape(result.reason)}</error>')
        lines.append("    </testcase>")
    lines += ["  </testsuite>", "</testsuites>", ""]
    return "\n".join(lines)
