"""The report page: a header (source, processes), a summary, one card per finding with its
evidence, and the plots. Self-contained: inline CSS and SVG, no scripts, no fonts, nothing fetched.
"""

from __future__ import annotations

import time
from typing import Any

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.analysis.findings import ERROR, INFO, WARNING, Finding
from kvdoctor.analysis.gate_growth import growth_not_judged
from kvdoctor.analysis.slot_history import clean_pages, entry_line, report_lines
from kvdoctor.formats.reports.bounded import PROCESS_ROWS_SHOWN, first_processes, shown_findings
from kvdoctor.formats.reports.html.lanes import history_lanes
from kvdoctor.formats.reports.html.svg import memory_plot, slots_plot
from kvdoctor.formats.reports.html.text import escape as _e
from kvdoctor.formats.reports.html.text import human_bytes, human_duration, human_rate
from kvdoctor.trace import schema
from kvdoctor.units import as_float, as_int

MAX_LIST_ITEMS = 16
MAX_DICT_ITEMS = 10
MAX_TEXT = 400
PLOTS_SHOWN_PER_KIND = 24  # memory plots (those with a growth finding first) and KV slot plots

CSS = """
*{box-sizing:border-box}
body{margin:0;background:#f4f5f7;color:#1f2937;font:14px/1.45 -apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
main{max-width:960px;margin:0 auto;padding:24px 20px 48px}
header.top{background:#111827;color:#f9fafb;padding:18px 20px}
header.top .inner{max-width:960px;margin:0 auto;padding:0 20px}
header.top h1{margin:0;font-size:20px;font-weight:600;letter-spacing:.2px}
header.top .source{color:#9ca3af;font-size:13px;word-break:break-all;margin-top:4px}
h2{font-size:16px;margin:28px 0 10px;color:#111827}
.panel{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:14px 16px;margin:10px 0}
table.procs{border-collapse:collapse;width:100%;font-size:13px}
table.procs th,table.procs td{text-align:left;padding:5px 8px;border-bottom:1px solid #f0f1f3;vertical-align:top}
table.procs th{color:#6b7280;font-weight:600}
table.procs td.title{word-break:break-all;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.summary{display:flex;gap:12px;flex-wrap:wrap}
.stat{flex:1;min-width:140px;background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px 16px}
.stat .n{font-size:26px;font-weight:700}
.stat .l{color:#6b7280;font-size:12px;text-transform:uppercase;letter-spacing:.5px}
.stat.error .n{color:#b91c1c}.stat.warning .n{color:#b45309}.stat.ok .n{color:#15803d}
.verdict{margin-top:10px;padding:10px 14px;border-radius:8px;font-weight:600}
.verdict.bad{background:#fef2f2;color:#991b1b;border:1px solid #fecaca}
.verdict.unjudged{background:#fffbeb;color:#92400e;border:1px solid #fde68a}
.verdict.good{background:#f0fdf4;color:#166534;border:1px solid #bbf7d0}
.card{background:#fff;border:1px solid #e5e7eb;border-left:5px solid #9ca3af;border-radius:8px;padding:12px 16px;margin:12px 0}
.card.error{border-left-color:#dc2626}.card.warning{border-left-color:#d97706}.card.info{border-left-color:#2563eb}
.card .head{display:flex;align-items:center;gap:10px;flex-wrap:wrap}
.card .kind{font-weight:700;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.badge{display:inline-block;border-radius:999px;padding:1px 9px;font-size:11px;font-weight:700;text-transform:uppercase;letter-spacing:.4px}
.badge.error{background:#fee2e2;color:#991b1b}.badge.warning{background:#fef3c7;color:#92400e}.badge.info{background:#dbeafe;color:#1e40af}
.count{color:#6b7280;font-size:13px}
.card .msg{margin:8px 0 6px;white-space:pre-wrap;word-break:break-word}
dl.ev{display:grid;grid-template-columns:max-content 1fr;gap:3px 14px;margin:8px 0 0;font-size:12.5px}
dl.ev dt{color:#6b7280;font-weight:600}
dl.ev dd{margin:0;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;word-break:break-word;white-space:pre-wrap}
.more{color:#9ca3af}
.plot{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px 14px;margin:12px 0}
.plot h3{margin:0 0 2px;font-size:14px}
.plot .sub{color:#6b7280;font-size:12px;margin-bottom:6px;word-break:break-all}
.plot .oom{margin:6px 0 0;color:#991b1b;font-weight:600;font-size:13px}
.legend{display:flex;flex-wrap:wrap;gap:4px 16px;font-size:12px;color:#374151;margin-top:4px}
.legend span.sw{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-2px}
.notes li{color:#4b5563}
.empty{color:#6b7280;font-style:italic}
svg text{font-family:-apple-system,"Segoe UI",Roboto,Arial,sans-serif}
footer{color:#9ca3af;font-size:12px;margin-top:32px}
"""


def _finding_pid(finding: Finding) -> int:
    return as_int(finding.evidence.get("pid", finding.pid), default=finding.pid)


def _clock(key: str, value: Any) -> str:
    """A time of day for a value that is one (seconds or microseconds since the epoch), else ""."""
    v = as_float(value) if not isinstance(value, bool) else None
    if v is None:
        return ""
    if key.endswith("_us") and 1e15 <= v < 1e17:
        v /= 1e6
    elif not (key.endswith(("_s", "_ts", "ts")) and 1e9 <= v < 1e11):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(v))


def _value_html(value: Any, depth: int = 0) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        shown = ", ".join(_e(_short(x)) for x in items[:MAX_LIST_ITEMS])
        more = (
            f' <span class="more">… ({len(items) - MAX_LIST_ITEMS} more, {len(items)} in all)</span>' if len(items) > MAX_LIST_ITEMS else ""
        )
        return f"[{shown}]{more}"
    if isinstance(value, dict) and depth == 0:
        items = list(value.items())
        lines = [f"{_e(_short(k))}: {_value_html(v, depth + 1)}" for k, v in items[:MAX_DICT_ITEMS]]
        if len(items) > MAX_DICT_ITEMS:
            lines.append(f'<span class="more">… ({len(items) - MAX_DICT_ITEMS} more)</span>')
        return "\n".join(lines)
    if isinstance(value, float):
        return _e(f"{value:.6g}")
    return _e(_short(value))


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


def _evidence_extra(key: str, value: Any) -> str:
    """A human reading beside raw byte counts and rates."""
    v = as_float(value) if not isinstance(value, bool) else None
    if v is None:
        return ""
    if key.endswith("bytes_per_s"):
        return f"  ({human_rate(v)})"
    if key.endswith("bytes_per_hour"):
        return f"  ({human_bytes(v)}/h)"
    if key.endswith("_bytes") and abs(v) >= 1024:
        return f"  ({human_bytes(v)})"
    if key.endswith("_s") and 120 <= abs(v) < 1e8:  # larger values are timestamps, not durations
        return f"  ({human_duration(v)})"
    return ""


def finding_card(finding: Finding, processes: dict[int, dict[str, Any]]) -> str:
    sev = finding.severity if finding.severity in (ERROR, WARNING, INFO) else "info"
    rows = []
    for key, value in finding.evidence.items():
        if key == schema.SLOT_HISTORY:  # the flight recorder: the terminal's timeline, not its raw entries
            lanes = history_lanes(clean_pages(value), entry_line)
            timeline = "\n".join(line.strip() for line in report_lines(finding.evidence, ""))
            rows.append(f"<dt>{_e(key)}</dt><dd>{lanes}{_e(timeline)}</dd>")
            continue
        clock = _clock(str(key), value)
        shown = _e(clock) if clock else f"{_value_html(value)}{_e(_evidence_extra(str(key), value))}"
        rows.append(f"<dt>{_e(key)}</dt><dd>{shown}</dd>")
    pid = finding.pid
    who = ""
    if pid:
        title = (processes.get(pid) or {}).get("process_title", "")
        who = f'<span class="count">pid {pid}{(" · " + _e(_short(title)[:90])) if title else ""}</span>'
    count = f'<span class="count">×{_e(finding.counted())}</span>' if finding.count else ""
    ev = f'<dl class="ev">{"".join(rows)}</dl>' if rows else ""
    return (
        f'<div class="card {sev}"><div class="head"><span class="badge {sev}">{_e(sev)}</span>'
        f'<span class="kind">{_e(finding.kind)}</span>{count}{who}</div>'
        f'<div class="msg">{_e(finding.message)}</div>{ev}</div>'
    )


def _process_title(pid: int, processes: dict[int, dict[str, Any]]) -> str:
    info = processes.get(pid) or {}
    title = str(info.get("process_title") or "")
    return f"pid {pid}" + (f" ({title[:60]})" if title else "")


def _parse_label(label: str) -> tuple[str, int, str]:
    kind, _, rest = label.partition(":")
    pid_text, _, name = rest.partition(":")
    try:
        pid = int(pid_text)
    except ValueError:
        pid = 0
    return kind, pid, name


def _leaked(findings: list[Finding], censuses: dict[int, dict[str, Any]], pid: int, allocator: str) -> tuple[float, int] | None:
    """(when, how many): the slots of one ledger its last census found leaked, as its findings count them."""
    since = as_float((censuses.get(pid) or {}).get("ts_us"))
    orphans = sum(
        f.count
        for f in findings
        if f.kind == schema.ORPHAN_SLOTS
        and f.pid == pid
        and f.evidence.get("allocator") == allocator
        and f.evidence.get("census") != "release"
    )
    return (since, orphans) if since is not None and orphans > 0 else None


def render_html(analysis: Analysis) -> str:
    findings = list(analysis.findings)
    errors = sum(1 for f in findings if f.severity == ERROR)
    warnings = sum(1 for f in findings if f.severity == WARNING)
    infos = len(findings) - errors - warnings
    processes = analysis.processes or {}

    out: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>kvdoctor report — {_e(analysis.source or 'analysis')}</title>",
        f"<style>{CSS}</style></head><body>",
        '<header class="top"><div class="inner"><h1>kvdoctor report</h1>',
        f'<div class="source">{_e(analysis.source or "(live analysis)")} · {analysis.events} events</div></div></header>',
        "<main>",
    ]

    out.append("<h2>Summary</h2>")
    out.append('<div class="summary">')
    out.append(f'<div class="stat {"error" if errors else "ok"}"><div class="n">{errors}</div><div class="l">errors</div></div>')
    out.append(f'<div class="stat {"warning" if warnings else "ok"}"><div class="n">{warnings}</div><div class="l">warnings</div></div>')
    out.append(f'<div class="stat"><div class="n">{infos}</div><div class="l">info</div></div>')
    out.append(f'<div class="stat"><div class="n">{len(processes)}</div><div class="l">processes</div></div>')
    out.append("</div>")
    unjudged = growth_not_judged(analysis)
    if errors:
        out.append(f'<div class="verdict bad">{errors} error finding(s): the traced processes broke KV or memory safety rules.</div>')
    elif unjudged:
        out.append('<div class="verdict unjudged">No error findings, but memory growth was not judged.</div>')
    else:
        out.append('<div class="verdict good">No error findings.</div>')
    if unjudged:
        out.append(f'<div class="verdict unjudged">{_e(unjudged)}</div>')

    out.append("<h2>Processes</h2>")
    if processes:
        rows, unlisted = first_processes(processes, PROCESS_ROWS_SHOWN)
        out.append('<div class="panel"><table class="procs"><tr><th>pid</th><th>engine</th><th>version</th><th>title</th></tr>')
        for pid, info in rows:
            info = info or {}
            out.append(
                f"<tr><td>{pid}</td><td>{_e(info.get('engine') or '—')}</td><td>{_e(info.get('engine_version') or '—')}</td>"
                f'<td class="title">{_e(_short(info.get("process_title") or ""))}</td></tr>'
            )
        out.append("</table>" + (f'<div class="more">… and {unlisted} more process(es)</div>' if unlisted else "") + "</div>")
    else:
        out.append('<div class="panel empty">No process wrote a header into this trace.</div>')

    out.append("<h2>Findings</h2>")
    if findings:
        shown, left = shown_findings(findings)
        out.extend(finding_card(f, processes) for f in shown)
        out.extend(f'<div class="panel more">{_e(rest.sentence())}</div>' for rest in left)
    else:
        out.append('<div class="panel empty">No findings.</div>')

    series = analysis.series or {}
    plots: list[str] = []
    starts = [e["ts_us"][0] for e in series.values() if e.get("ts_us")]
    t0 = min(starts) if starts else 0.0
    growth = [f for f in findings if f.kind == schema.MEMORY_GROWTH]
    growing = {_finding_pid(f) for f in growth}
    drawn = {schema.MEMORY_COUNTER: 0, schema.LEDGER_COUNTER: 0}
    undrawn = 0

    def plot_order(label: str) -> tuple[bool, bool, str]:
        kind, pid, _ = _parse_label(label)
        return kind != schema.MEMORY_COUNTER, pid not in growing, label

    for label in sorted(series, key=plot_order):
        kind, pid, name = _parse_label(label)
        if kind not in drawn:
            continue
        if drawn[kind] >= PLOTS_SHOWN_PER_KIND:
            undrawn += 1
            continue
        drawn[kind] += 1
        entry = series[label]
        title = _process_title(pid, processes) + (f" · {_short(name)}" if name and kind != schema.MEMORY_COUNTER else "")
        if kind == schema.MEMORY_COUNTER:
            mine = [f for f in growth if _finding_pid(f) == pid]
            plots.append(memory_plot(label, entry, t0, mine, title))
        else:
            plots.append(slots_plot(label, entry, t0, title, _leaked(findings, analysis.last_censuses, pid, name)))
    plots = [p for p in plots if p]
    if undrawn:
        plots.append(f'<div class="panel more">… and {undrawn} more series not drawn ({PLOTS_SHOWN_PER_KIND} of each kind are)</div>')
    out.append("<h2>Over time</h2>")
    if plots:
        out.extend(plots)
    else:
        out.append('<div class="panel empty">The trace has no memory or KV slot counters to plot.</div>')

    if analysis.notes:
        out.append('<h2>Notes</h2><ul class="notes">')
        out.extend(f"<li>{_e(n)}</li>" for n in analysis.notes)
        out.append("</ul>")
    out.append("<footer>Generated by kvdoctor. Self-contained: no scripts, no external resources.</footer>")
    out.append("</main></body></html>")
    return "\n".join(out) + "\n"
