"""Reporters render a finished Analysis; each knows nothing of how it was made."""

from __future__ import annotations

from kvdoctor.analysis.analyzer import Analysis


def render(analysis: Analysis, output_format: str) -> str:
    if output_format == "json":
        from kvdoctor.reporters.json_report import render_json

        return render_json(analysis)
    if output_format == "html":
        from kvdoctor.reporters.html import render_html

        return render_html(analysis)
    from kvdoctor.reporters.terminal import render_text

    return render_text(analysis)
