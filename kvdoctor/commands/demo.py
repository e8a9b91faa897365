"""`kvdoctor demo`: SGLang's real allocator and radix tree, a multi-turn chat workload, a planted
fault, and the diagnosis a user would get. No GPU, no model, no download."""

from __future__ import annotations

import importlib.machinery
import os
import sys

from kvdoctor.analysis.analyzer import exit_code_for
from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK, KvdoctorError
from kvdoctor.formats.reports import render
from kvdoctor.formats.table import check_format
from kvdoctor.outputs import to_stdout

NEEDED = {"torch": "torch", "sglang": "SGLang"}  # module -> what to call it


def check_demo_needs() -> None:
    """A one-line refusal where this Python lacks what the demo runs on (SGLang's real classes, on
    torch), before anything imports them: kvdoctor installed on its own has neither."""
    # PathFinder, not importlib.util.find_spec: a look-up through sys.meta_path is what the probe's
    # start-up hook (kvdoctor/probe/core/entry.py) waits for, and would turn on the probe of a `kvdoctor
    # run` around this demo before the demo's own, whose trace would then stay empty
    missing = [name for module, name in NEEDED.items() if importlib.machinery.PathFinder.find_spec(module) is None]
    if missing:
        raise KvdoctorError(
            f"the demo needs {' and '.join(NEEDED.values())} (it runs SGLang's real allocator and radix tree), and this Python "
            f"({sys.executable}) has {'neither' if len(missing) == len(NEEDED) else 'no ' + missing[0]}",
            "install kvdoctor into your SGLang environment and run it there: that environment's `pip install` of kvdoctor's "
            "checkout or wheel; or, in a kvdoctor checkout: `bash .ci/setup && .venv/bin/kvdoctor demo`",
        )


def demo(fault: str, page_size: int | None, trace_path: str | None, output_format: str = "text", *, force: bool = False) -> int:
    check_format(output_format, "demo")
    check_demo_needs()
    from kvdoctor.runner.demo import run_demo  # imports SGLang's classes, and torch

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
