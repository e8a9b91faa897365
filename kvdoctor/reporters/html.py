"""HTML: one self-contained page (inline CSS and SVG, no scripts, no fonts, nothing fetched).

The page has a header (source, processes), a summary, one card per finding with its evidence,
and plots drawn as inline SVG: every memory series by class over time (with the fitted trend and
the projected out-of-memory time when a memory_growth finding names it), and every KV slot
ledger as a stacked area of free / owned / tree slots.
"""

from __future__ import annotations

import html
import math
from typing import Any, Iterable, Sequence

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.analysis.findings import ERROR, INFO, WARNING, Finding
from kvdoctor.trace import schema
from kvdoctor.units import as_float, as_int, format_bytes, format_duration, format_rate

MAX_LIST_ITEMS = 16
MAX_DICT_ITEMS = 10
MAX_TEXT = 400
REPORT_DIGITS = 1   # "1.5 GiB": one decimal everywhere on the page

PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"]
SLOT_COLOURS = {"free_slots": "#86efac", "owned_slots": "#93c5fd", "tree_slots": "#fcd34d", "unaccounted_slots": "#fca5a5"}
SLOT_LABELS = {"free_slots": "free", "owned_slots": "owned by requests", "tree_slots": "in radix tree", "unaccounted_slots": "unaccounted"}

WIDTH = 880
HEIGHT = 300
MARGIN_L = 78
MARGIN_R = 20
MARGIN_T = 16
MARGIN_B = 46
MIN_SPAN_S = 0.5   # samples closer together than this are drawn as one (the last)

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


# ---------------------------------------------------------------------------------------------
# units


def human_bytes(value: float) -> str:
    return format_bytes(value, REPORT_DIGITS)


def human_rate(bytes_per_s: float) -> str:
    return format_rate(bytes_per_s, digits=REPORT_DIGITS)


def human_duration(seconds: float) -> str:
    return format_duration(seconds, "readable")


def _byte_unit(max_value: float) -> tuple[float, str]:
    for scale, name in ((1024.0 ** 4, "TiB"), (1024.0 ** 3, "GiB"), (1024.0 ** 2, "MiB"), (1024.0, "KiB")):
        if max_value >= scale:
            return scale, name
    return 1.0, "B"


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s >= 3 * 3600:
        return 3600.0, "h"
    if span_s >= 180:
        return 60.0, "min"
    return 1.0, "s"


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (in display units)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        step = m * mag
        if step >= raw:
            break
    start = math.floor(lo / step) * step
    ticks = []
    v = start
    while v <= hi + step * 1e-9 and len(ticks) < 50:
        if v >= lo - step * 1e-9:
            ticks.append(round(v, 10))
        v += step
    return ticks


def _fmt_tick(v: float) -> str:
    if abs(v - round(v)) < 1e-9:
        return f"{int(round(v))}"
    if abs(v * 10 - round(v * 10)) < 1e-6:
        return f"{v:.1f}"
    return f"{v:.2f}"


# ---------------------------------------------------------------------------------------------
# SVG plotting


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


class _Frame:
    """Maps data (seconds, values) to pixel space and draws the axes."""

    def __init__(self, x_lo: float, x_hi: float, y_lo: float, y_hi: float, *, y_scale: float, y_unit: str,
                 x_scale: float, x_unit: str, width: int = WIDTH, height: int = HEIGHT) -> None:
        if x_hi <= x_lo:
            x_hi = x_lo + 1.0
        if y_hi <= y_lo:
            y_hi = y_lo + (abs(y_lo) or 1.0)
        self.w, self.h = width, height
        self.x_scale, self.x_unit = x_scale, x_unit
        self.y_scale, self.y_unit = y_scale, y_unit
        self.x_ticks = nice_ticks(x_lo / x_scale, x_hi / x_scale, 8)
        self.y_ticks = nice_ticks(y_lo / y_scale, y_hi / y_scale, 6)
        self.x_lo = min(x_lo, self.x_ticks[0] * x_scale)
        self.x_hi = max(x_hi, self.x_ticks[-1] * x_scale)
        self.y_lo = min(y_lo, self.y_ticks[0] * y_scale)
        self.y_hi = max(y_hi, self.y_ticks[-1] * y_scale)
        self.x_label_override = ""

    def px(self, x: float) -> float:
        return MARGIN_L + (x - self.x_lo) / (self.x_hi - self.x_lo) * (self.w - MARGIN_L - MARGIN_R)

    def py(self, y: float) -> float:
        return self.h - MARGIN_B - (y - self.y_lo) / (self.y_hi - self.y_lo) * (self.h - MARGIN_T - MARGIN_B)

    def axes(self, y_label: str) -> list[str]:
        if self.x_label_override:
            return self._axes(y_label, show_x_ticks=False, x_label=self.x_label_override)
        return self._axes(y_label, show_x_ticks=True, x_label=f"time since trace start ({self.x_unit})")

    def _axes(self, y_label: str, *, show_x_ticks: bool, x_label: str) -> list[str]:
        out = []
        left, right = MARGIN_L, self.w - MARGIN_R
        top, bottom = MARGIN_T, self.h - MARGIN_B
        for t in self.y_ticks:
            y = self.py(t * self.y_scale)
            out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#eef0f3"/>')
            out.append(f'<text x="{left - 8}" y="{y + 4:.1f}" font-size="11" fill="#6b7280" text-anchor="end">{_e(_fmt_tick(t))}</text>')
        for t in (self.x_ticks if show_x_ticks else []):
            x = self.px(t * self.x_scale)
            out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#f5f6f8"/>')
            out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#9ca3af"/>')
            out.append(f'<text x="{x:.1f}" y="{bottom + 17}" font-size="11" fill="#6b7280" text-anchor="middle">{_e(_fmt_tick(t))}</text>')
        out.append(f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#9ca3af"/>')
        out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#9ca3af"/>')
        out.append(f'<text x="{(left + right) / 2:.1f}" y="{self.h - 8}" font-size="12" fill="#374151" text-anchor="middle">'
                   f'{_e(x_label)}</text>')
        cy = (top + bottom) / 2
        out.append(f'<text x="16" y="{cy:.1f}" font-size="12" fill="#374151" text-anchor="middle" '
                   f'transform="rotate(-90 16 {cy:.1f})">{_e(y_label)}</text>')
        return out


def _svg(frame: _Frame, body: list[str], title: str, y_label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {frame.w} {frame.h}" width="100%" '
            f'role="img" aria-label="{_e(title)}" preserveAspectRatio="xMidYMid meet">'
            f'<title>{_e(title)}</title>' + "".join(frame.axes(y_label)) + "".join(body) + "</svg>")


def _polyline(points: Sequence[tuple[float, float]], colour: str, *, width: float = 2.0, dash: str = "") -> str:
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    return f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="{width}" stroke-linejoin="round"{dash_attr}/>'


def _markers(points: Sequence[tuple[float, float]], colour: str, limit: int = 40) -> list[str]:
    if len(points) > limit:
        return []
    return [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in points]


def _legend(items: Iterable[tuple[str, str, str]]) -> str:
    parts = []
    for colour, label, extra in items:
        style = f"background:{colour}" if not extra else f"background:repeating-linear-gradient(90deg,{colour} 0 4px,transparent 4px 7px)"
        parts.append(f'<span><span class="sw" style="{style}"></span>{_e(label)}</span>')
    return '<div class="legend">' + "".join(parts) + "</div>"


def _class_name(field: str) -> str:
    return field[:-6] if field.endswith("_bytes") else field


def _finding_matches_field(finding: Finding, field: str) -> bool:
    cls = str(finding.evidence.get("memory_class", "") or "")
    if not cls:
        return False
    return cls == field or cls == _class_name(field) or cls + "_bytes" == field


def _finding_pid(finding: Finding) -> int:
    return as_int(finding.evidence.get("pid", finding.pid), default=finding.pid)


def memory_plot(label: str, entry: dict[str, Any], t0_us: float, growth: list[Finding], title: str) -> str:
    ts = [(t - t0_us) / 1e6 for t in entry.get("ts_us", [])]
    values = entry.get("values", [])
    fields = sorted({k for v in values for k in v if k.endswith("_bytes")},
                    key=lambda k: (k != "rss_bytes", k))
    fields = [f for f in fields if any(v.get(f) for v in values)] or fields
    if not ts or not fields:
        return ""
    trends = []
    for f in growth:
        rate = as_float(f.evidence.get("bytes_per_s"))
        match = next((fld for fld in fields if _finding_matches_field(f, fld)), None)
        if rate is None or match is None:
            continue
        last = next(((t, v[match]) for t, v in zip(reversed(ts), reversed(values)) if match in v), None)
        if last is None:
            continue
        trends.append((f, match, rate, last))
    span = max(ts[-1] - ts[0], 1e-9) if len(ts) > 1 else 1.0
    x_lo, x_hi = ts[0], ts[-1]
    if trends:
        x_hi = ts[-1] + 0.15 * span
    if len(ts) > 1 and ts[-1] - ts[0] < MIN_SPAN_S:
        ts, values = ts[-1:], values[-1:]
    if len(ts) == 1:
        x_lo, x_hi = ts[0] - 1.0, ts[0] + 1.0
    all_vals = [v[f] for v in values for f in fields if f in v]
    y_hi = max(all_vals) if all_vals else 1.0
    y_lo = 0.0
    for f, match, rate, (lt, lv) in trends:
        y_hi = max(y_hi, lv + rate * (x_hi - lt), lv + rate * (ts[0] - lt))
        y_lo = min(y_lo, lv + rate * (ts[0] - lt))
    y_hi *= 1.05
    y_scale, y_unit = _byte_unit(max(abs(y_hi), abs(y_lo)))
    x_scale, x_unit = _time_unit(x_hi - x_lo)
    frame = _Frame(x_lo, x_hi, y_lo, y_hi, y_scale=y_scale, y_unit=y_unit, x_scale=x_scale, x_unit=x_unit)
    if len(ts) == 1:
        frame.x_label_override = f"one sample, at {human_duration(ts[0])} after trace start"
    body: list[str] = []
    legend = []
    colours = {}
    for i, field in enumerate(fields):
        colour = PALETTE[i % len(PALETTE)]
        colours[field] = colour
        pts = [(frame.px(t), frame.py(v[field])) for t, v in zip(ts, values) if field in v]
        if len(pts) > 1:
            body.append(_polyline(pts, colour))
        body.extend(_markers(pts, colour, limit=40 if len(pts) > 1 else 1))
        legend.append((colour, _class_name(field), ""))
    oom_lines = []
    for f, match, rate, (lt, lv) in trends:
        colour = colours.get(match, "#111827")
        a = (ts[0], lv + rate * (ts[0] - lt))
        b = (x_hi, lv + rate * (x_hi - lt))
        body.append(_polyline([(frame.px(a[0]), frame.py(a[1])), (frame.px(b[0]), frame.py(b[1]))], "#111827", width=1.6, dash="7 5"))
        bx, by = frame.px(lt), frame.py(lv)
        body.append(f'<circle cx="{bx:.1f}" cy="{by:.1f}" r="4.5" fill="none" stroke="#111827" stroke-width="1.5"/>')
        text = f"trend {human_rate(rate)}"
        tx = min(frame.px(b[0]) - 4, WIDTH - MARGIN_R - 4)
        ty = max(frame.py(b[1]) - 8, MARGIN_T + 12)
        body.append(f'<text x="{tx:.1f}" y="{ty:.1f}" font-size="12" font-weight="600" fill="#111827" text-anchor="end">{_e(text)}</text>')
        legend.append(("#111827", f"fitted trend of {_class_name(match)} ({human_rate(rate)})", "dash"))
        oom = as_float(f.evidence.get("time_to_oom_s"))
        if oom is not None and oom > 0:
            oom_lines.append(f"{_class_name(match)} grows {human_rate(rate)}: projected out of memory in {human_duration(oom)} after the last sample")
        else:
            oom_lines.append(f"{_class_name(match)} grows {human_rate(rate)} (no memory limit known to project an out-of-memory time)")
    svg = _svg(frame, body, f"memory of {title}", f"memory ({y_unit})")
    n = len(entry.get("ts_us", []))
    sub = f"{_e(label)} · {n} sample{'s' if n != 1 else ''}" + (f" over {_e(human_duration(ts[-1] - ts[0]))}" if len(ts) > 1 else "")
    oom_html = "".join(f'<p class="oom">{_e(line)}</p>' for line in oom_lines)
    return (f'<div class="plot"><h3>Memory by class — {_e(title)}</h3><div class="sub">{sub}</div>'
            f"{svg}{_legend(legend)}{oom_html}</div>")


def slots_plot(label: str, entry: dict[str, Any], t0_us: float, title: str) -> str:
    ts = [(t - t0_us) / 1e6 for t in entry.get("ts_us", [])]
    values = entry.get("values", [])
    if not ts:
        return ""
    layers = [k for k in ("free_slots", "owned_slots", "tree_slots", "unaccounted_slots")
              if any(v.get(k) for v in values) or k in ("free_slots", "owned_slots", "tree_slots")]
    totals = [v.get("total_slots") for v in values]
    stacked_max = max(sum(v.get(k, 0) or 0 for k in layers) for v in values)
    y_hi = max([stacked_max] + [t for t in totals if isinstance(t, (int, float))]) * 1.05 or 1.0
    single = len(ts) == 1 or ts[-1] - ts[0] < MIN_SPAN_S
    if single:
        ts, values, totals = ts[-1:], values[-1:], totals[-1:]
    x_lo, x_hi = (ts[0] - 1.0, ts[0] + 1.0) if single else (ts[0], ts[-1])
    x_scale, x_unit = _time_unit(x_hi - x_lo)
    frame = _Frame(x_lo, x_hi, 0.0, y_hi, y_scale=1.0, y_unit="slots", x_scale=x_scale, x_unit=x_unit)
    if single:
        frame.x_label_override = f"one sample, at {human_duration(ts[0])} after trace start"
    body: list[str] = []
    if single:
        # one sample: a stacked column at its time, labelled with the counts
        v = values[0]
        cx = frame.px(ts[0])
        half = 60
        base = 0.0
        for k in layers:
            n = float(v.get(k, 0) or 0)
            if n <= 0:
                continue
            y1, y0 = frame.py(base + n), frame.py(base)
            body.append(f'<rect x="{cx - half:.1f}" y="{y1:.1f}" width="{2 * half}" height="{max(y0 - y1, 0.5):.1f}" '
                        f'fill="{SLOT_COLOURS[k]}" stroke="#ffffff" stroke-width="1"/>')
            if y0 - y1 >= 14:
                body.append(f'<text x="{cx:.1f}" y="{(y0 + y1) / 2 + 4:.1f}" font-size="11" fill="#1f2937" text-anchor="middle">'
                            f'{_e(SLOT_LABELS[k])}: {int(n)}</text>')
            base += n
    else:
        base = [0.0] * len(ts)
        for k in layers:
            top = [b + float(v.get(k, 0) or 0) for b, v in zip(base, values)]
            upper = [(frame.px(t), frame.py(y)) for t, y in zip(ts, top)]
            lower = [(frame.px(t), frame.py(y)) for t, y in zip(reversed(ts), reversed(base))]
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in upper + lower)
            body.append(f'<polygon points="{pts}" fill="{SLOT_COLOURS[k]}" fill-opacity="0.9" stroke="none"/>')
            body.append(_polyline(upper, "#ffffff", width=0.8))
            base = top
    total_pts = [(frame.px(t), frame.py(tot)) for t, tot in zip(ts, totals) if isinstance(tot, (int, float))]
    if total_pts:
        if single:
            x, y = total_pts[0]
            body.append(_polyline([(x - 80, y), (x + 80, y)], "#111827", width=1.4, dash="5 4"))
        else:
            body.append(_polyline(total_pts, "#111827", width=1.4, dash="5 4"))
    svg = _svg(frame, body, f"KV slots of {title}", "KV slots")
    legend = [(SLOT_COLOURS[k], SLOT_LABELS[k], "") for k in layers]
    if total_pts:
        legend.append(("#111827", "total slots", "dash"))
    last = values[-1]
    counts = ", ".join(f"{SLOT_LABELS[k]} {int(last.get(k, 0) or 0)}" for k in layers)
    n = len(entry.get("ts_us", []))
    sub = (f"{_e(label)} · {n} sample{'s' if n != 1 else ''}"
           + (f" over {_e(human_duration(ts[-1] - ts[0]))}" if len(ts) > 1 else
              f", the last at {_e(human_duration(ts[0]))}" if n > 1 else f" at {_e(human_duration(ts[0]))}")
           + f" · last: {_e(counts)}")
    return (f'<div class="plot"><h3>KV slot ledger — {_e(title)}</h3><div class="sub">{sub}</div>'
            f"{svg}{_legend(legend)}</div>")


# ---------------------------------------------------------------------------------------------
# page parts


def _value_html(value: Any, depth: int = 0) -> str:
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        shown = ", ".join(_e(_short(x)) for x in items[:MAX_LIST_ITEMS])
        more = f' <span class="more">… ({len(items) - MAX_LIST_ITEMS} more, {len(items)} in all)</span>' if len(items) > MAX_LIST_ITEMS else ""
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
        rows.append(f"<dt>{_e(key)}</dt><dd>{_value_html(value)}{_e(_evidence_extra(str(key), value))}</dd>")
    pid = finding.pid
    who = ""
    if pid:
        title = (processes.get(pid) or {}).get("process_title", "")
        who = f'<span class="count">pid {pid}{(" · " + _e(_short(title)[:90])) if title else ""}</span>'
    count = f'<span class="count">×{finding.count}</span>' if finding.count else ""
    ev = f'<dl class="ev">{"".join(rows)}</dl>' if rows else ""
    return (f'<div class="card {sev}"><div class="head"><span class="badge {sev}">{_e(sev)}</span>'
            f'<span class="kind">{_e(finding.kind)}</span>{count}{who}</div>'
            f'<div class="msg">{_e(finding.message)}</div>{ev}</div>')


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
    if errors:
        out.append(f'<div class="verdict bad">{errors} error finding(s): the traced processes broke KV or memory safety rules.</div>')
    else:
        out.append('<div class="verdict good">No error findings.</div>')

    out.append("<h2>Processes</h2>")
    if processes:
        out.append('<div class="panel"><table class="procs"><tr><th>pid</th><th>engine</th><th>version</th><th>title</th></tr>')
        for pid in sorted(processes):
            info = processes[pid] or {}
            out.append(f"<tr><td>{pid}</td><td>{_e(info.get('engine') or '—')}</td><td>{_e(info.get('engine_version') or '—')}</td>"
                       f'<td class="title">{_e(info.get("process_title") or "")}</td></tr>')
        out.append("</table></div>")
    else:
        out.append('<div class="panel empty">No process wrote a header into this trace.</div>')

    out.append("<h2>Findings</h2>")
    if findings:
        out.extend(finding_card(f, processes) for f in findings)
    else:
        out.append('<div class="panel empty">No findings.</div>')

    series = analysis.series or {}
    plots: list[str] = []
    starts = [e["ts_us"][0] for e in series.values() if e.get("ts_us")]
    t0 = min(starts) if starts else 0.0
    growth = [f for f in findings if f.kind == schema.MEMORY_GROWTH]
    for label in sorted(series, key=lambda s: (not s.startswith(schema.MEMORY_COUNTER + ":"), s)):
        kind, pid, name = _parse_label(label)
        entry = series[label]
        title = _process_title(pid, processes) + (f" · {name}" if name and kind != schema.MEMORY_COUNTER else "")
        if kind == schema.MEMORY_COUNTER:
            mine = [f for f in growth if _finding_pid(f) == pid]
            plots.append(memory_plot(label, entry, t0, mine, title))
        elif kind == schema.LEDGER_COUNTER:
            plots.append(slots_plot(label, entry, t0, title))
    plots = [p for p in plots if p]
    out.append("<h2>Over time</h2>")
    if plots:
        out.extend(plots)
    else:
        out.append('<div class="panel empty">The trace has no memory or KV slot counters to plot.</div>')

    if analysis.notes:
        out.append("<h2>Notes</h2><ul class=\"notes\">")
        out.extend(f"<li>{_e(n)}</li>" for n in analysis.notes)
        out.append("</ul>")
    out.append("<footer>Generated by kvdoctor. Self-contained: no scripts, no external resources.</footer>")
    out.append("</main></body></html>")
    return "\n".join(out) + "\n"
