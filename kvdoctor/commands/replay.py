"""`kvdoctor replay TRACE`: run every detector over a recorded trace and render the findings."""

from __future__ import annotations

import sys

from kvdoctor.analysis.analyzer import exit_code_for
from kvdoctor.reporters import check_format, render
from kvdoctor.runner import analyze_recorded


def replay(path: str, output_format: str = "text", output: str | None = None) -> int:
    check_format(output_format)
    analysis = analyze_recorded(path, progress=True)
    text = render(analysis, output_format)
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
        print(f"kvdoctor: wrote {output_format} report to {output} ({len(analysis.findings)} findings)", file=sys.stderr)
    else:
        print(text)
    return exit_code_for(analysis)
