"""Reporters render a finished Analysis; each knows nothing of how it was made.

`render(analysis, format)` is the one way in, and `check_format` the one check of a `--format`
value, so a command refuses a format it cannot write before it does any work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.errors import KvdoctorError

REPORT_FORMATS = ("text", "json", "jsonl", "html")


def check_format(output_format: str, allowed: Sequence[str] = REPORT_FORMATS) -> str:
    """`output_format` when it is one of `allowed`, else a one-line refusal (exit 2)."""
    if output_format not in allowed:
        raise KvdoctorError(f"unknown format {output_format!r}", "choose " + ", ".join(allowed))
    return output_format


def _renderer(output_format: str) -> Callable[[Analysis], str]:
    check_format(output_format)
    if output_format == "json":
        from kvdoctor.reporters.json_report import render_json

        return render_json
    if output_format == "jsonl":
        from kvdoctor.reporters.jsonl import render_jsonl

        return render_jsonl
    if output_format == "html":
        from kvdoctor.reporters.html import render_html

        return render_html
    from kvdoctor.reporters.terminal import render_text

    return render_text


def render(analysis: Analysis, output_format: str) -> str:
    return _renderer(output_format)(analysis)
