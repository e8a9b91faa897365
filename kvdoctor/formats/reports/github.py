"""GitHub Actions annotations for a gate result: each failed check becomes an `::error` line,
which Actions shows on the run's summary page; a check that passed with a warning, `::warning`."""

from __future__ import annotations

import os

from kvdoctor.analysis.gate_result import GateResult
from kvdoctor.outputs import one_line

TITLE = "kvdoctor gate"


def in_github_actions() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def _escape(text: str) -> str:
    """Workflow commands end at a newline: a newline, a carriage return or a control byte a trace
    carried is written out (`one_line`), so a request id can neither end an annotation nor start
    a command of its own, and `%` is GitHub's own escape."""
    return one_line(text).replace("%", "%25")


def github_annotations(result: GateResult) -> list[str]:
    lines = [f"::error title={TITLE}::{_escape(c.name + ': ' + c.detail)}" for c in result.failed]
    if not result.judged:
        lines.append(f"::error title={TITLE}::could not judge: {_escape(result.reason)}")
    lines += [f"::error title={TITLE}::could not judge {_escape(c.name + ': ' + c.detail)}" for c in result.unjudged]
    lines += [f"::warning title={TITLE}::{_escape(c.name + ': ' + c.detail)}" for c in result.warned]
    return lines
