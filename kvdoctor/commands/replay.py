"""`kvdoctor replay TRACE`: run every detector over a recorded trace and render the findings;
`--slot N`: print what the slot ledgers' flight recorder kept of slot N."""

from __future__ import annotations

import sys

from kvdoctor.analysis.analyzer import exit_code_for
from kvdoctor.errors import EXIT_UNUSABLE, KvdoctorError
from kvdoctor.formats.reports import render
from kvdoctor.formats.table import check_format
from kvdoctor.outputs import claim_output, names_stdout, to_stdout, write_private
from kvdoctor.runner import analyze_recorded, export_pprof


def replay(
    path: str,
    output_format: str = "text",
    output: str | None = None,
    *,
    force: bool = False,
    pprof: str | None = None,
    slot: int | None = None,
) -> int:
    if slot is not None:
        return slot_history(path, slot)
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


def slot_history(path: str, slot: int) -> int:
    """Every history of `slot` the trace's violations and censuses carry, each once, in trace
    order; a sentence where it holds none (0 either way: nothing was judged)."""
    from kvdoctor.analysis.slot_history import find_slot, timeline
    from kvdoctor.outputs import one_line
    from kvdoctor.trace.reader import iter_events

    lines, seen = [], set()
    for event, page in find_slot(iter_events(path), slot):
        key = (event.pid, str(event.args.get("allocator", "")), repr(page["entries"]))
        if key in seen:
            continue
        seen.add(key)
        what = event.args.get("kind") if event.name == "violation" else f"{event.args.get('reason', '')} census"
        lines.append(f"pid {event.pid}, {one_line(event.args.get('allocator', '?'))}: as the {one_line(what)} recorded it")
        lines += [one_line(line) for line in timeline(page, "  ")]
    if not lines:
        lines.append(
            f"kvdoctor: the trace holds no history of slot {slot}: histories are kept for the slots a violation or a census's "
            "orphans name (up to 8 pages each), on host slot ledgers with KVDOCTOR_SLOT_HISTORY on"
        )
    to_stdout("\n".join(lines))
    return 0
