"""`kvdoctor replay TRACE`: run every detector over a recorded trace and render the findings."""

from __future__ import annotations

import sys

from kvdoctor.analysis.analyzer import exit_code_for
from kvdoctor.errors import EXIT_UNUSABLE, KvdoctorError
from kvdoctor.formats.reports import render
from kvdoctor.formats.table import check_format
from kvdoctor.outputs import claim_output, names_stdout, to_stdout, write_private
from kvdoctor.runner import analyze_recorded, export_pprof


def replay(path: str, output_format: str = "text", output: str | None = None, *, force: bool = False, pprof: str | None = None) -> int:
    check_format(output_format, "replay")
    if output and names_stdout(output):
        output = None
    if output:
        claim_output(output, force=force, inputs=[path])  # refused before the analysis, not after
    analysis = analyze_recorded(path, progress=True)
    if pprof:
        export_pprof(path, analysis, pprof, force=force)
    text = render(analysis, output_format)
    code = exit_code_for(analysis)
    if not output:
        to_stdout(text)
        return code
    try:
        written = write_private(output, text, force=force, inputs=[path])
    except KvdoctorError as exc:  # the verdict stands: a failure stays a failure
        print(exc.one_line(), file=sys.stderr)
        return code or EXIT_UNUSABLE
    print(f"kvdoctor: wrote {output_format} report to {written} ({len(analysis.findings)} findings)", file=sys.stderr)
    return code
