"""GitHub Actions annotations for a gate result: each failed check becomes an `::error` line,
which Actions shows on the run's summary page."""

from __future__ import annotations

import os

from kvdoctor.analysis.gate import GateResult

TITLE = "kvdoctor gate"


def in_github_actions() -> bool:
    return os.environ.get("GITHUB_ACTIONS") == "true"


def _escape(text: str) -> str:
    """Workflow commands end at a newline; GitHub's own escapes keep a message on one line."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def github_annotations(result: GateResult) -> list[str]:
    if not result.judged:
        return [f"::error title={TITLE}::could not judge: {_escape(result.reason)}"]
    return [f"::error title={TITLE}::{_escape(c.name + ': ' + c.detail)}" for c in result.failed]
