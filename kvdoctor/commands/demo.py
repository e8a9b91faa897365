"""`kvdoctor demo`: SGLang's real allocator and radix tree, a multi-turn chat workload, a planted
fault, and the diagnosis a user would get. No GPU, no model, no download."""

from __future__ import annotations

import os
import sys

from kvdoctor.analysis.analyzer import exit_code_for
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK
from kvdoctor.outputs import to_stdout
from kvdoctor.reporters import check_format, render
from kvdoctor.runner.demo import run_demo


def demo(fault: str, page_size: int | None, trace_path: str | None, output_format: str = "text", *, force: bool = False) -> int:
    check_format(output_format)
    done = run_demo(fault, page_size, trace_path, force=force)
    if output_format == "text":
        lines = [*done.workload_lines(), render(done.analysis, "text")]
        lines.append(f"trace: {done.trace_path} (open it in Perfetto, or: kvdoctor replay {os.path.relpath(done.trace_path)})")
        to_stdout("\n".join(lines))
    else:
        to_stdout(render(done.analysis, output_format))
    if fault == "none":
        return exit_code_for(done.analysis)
    if not done.diagnosed:
        print(f"kvdoctor: the planted {fault} was not diagnosed", file=sys.stderr)
        return EXIT_FINDINGS
    return EXIT_OK
