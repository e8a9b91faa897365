"""The report's plots, drawn as inline SVG: memory by class over time (with the fitted trend of
a growth finding and its projected out-of-memory time), and each KV slot ledger as a stacked area
of free / owned / tree slots."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from kvdoctor.analysis.findings import Finding
from kvdoctor.formats.reports.html.text import escape as _e
from kvdoctor.formats.reports.html.text import human_duration, human_rate
from kvdoctor.units import as_float

PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"]
LEAKED = "leaked_slots"  # a band of its own: slots a census found held by no live request
SLOT_COLOURS = {
    "free_slots": "#86efac",
    "owned_slots": "#93c5fd",
    "tree_slots": "#fcd34d",
    "unaccounted_slots": "#fca5a5",
    LEAKED: "#dc2626",
}
SLOT_LABELS = {
    "free_slots": "free",
    "owned_slots": "owned by requests",
    "tree_slots": "in radix tree",
    "unaccounted_slots": "unaccounted",
    LEAKED: "leaked (no live request)",
}

WIDTH = 880
HEIGHT = 300
MARGIN_L = 78
MARGIN_R = 20
MARGIN_T = 16
MARGIN_B = 46
MIN_SPAN_S = 0.5  # samples closer together than this are drawn as one (the last)


def _byte_unit(max_value: float) -> tuple[float, str]:
    for scale, name in ((1024.0**4, "TiB"), (1024.0**3, "GiB"), (1024.0**2, "MiB"), (1024.0, "KiB")):
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
    ticks: list[float] = []
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


class _Frame:
    """Maps data (seconds, values) to pixel space and draws the axes."""

    def __init__(
        self,
        x_lo: float,
        x_hi: float,
        y_lo: float,
        y_hi: float,
        *,
        y_scale: float,
        y_unit: str,
        x_scale: float,
        x_unit: str,
        width: int = WIDTH,
        height: int = HEIGHT,
    ) -> None:
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
        for t in self.x_ticks if show_x_ticks else []:
            x = self.px(t * self.x_scale)
            out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#f5f6f8"/>')
            out.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#9ca3af"/>')
            out.append(f'<text x="{x:.1f}" y="{bottom + 17}" font-size="11" fill="#6b7280" text-anchor="middle">{_e(_fmt_tick(t))}</text>')
        out.append(f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#9ca3af"/>')
        out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#9ca3af"/>')
        out.append(
            f'<text x="{(left + right) / 2:.1f}" y="{self.h - 8}" font-size="12" fill="#374151" text-anchor="middle">{_e(x_label)}</text>'
        )
        cy = (top + bottom) / 2
        out.append(
            f'<text x="16" y="{cy:.1f}" font-size="12" fill="#374151" text-anchor="middle" '
            f'transform="rotate(-90 16 {cy:.1f})">{_e(y_label)}</text>'
        )
        return out


def _svg(frame: _Frame, body: list[str], title: str, y_label: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {frame.w} {frame.h}" width="100%" '
        f'role="img" aria-label="{_e(title)}" preserveAspectRatio="xMidYMid meet">'
        f"<title>{_e(title)}</title>" + "".join(frame.axes(y_label)) + "".join(body) + "</svg>"
    )


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


def memory_plot(label: str, entry: dict[str, Any], t0_us: float, growth: list[Finding], title: str) -> str:
    ts = [(t - t0_us) / 1e6 for t in entry.get("ts_us", [])]
    values = entry.get("values", [])
    fields = sorted({k for v in values for k in v if k.endswith("_bytes")}, key=lambda k: (k != "rss_bytes", k))
    fields = [f for f in fields if any(v.get(f) for v in values)] or fields
    if not ts or not fields:
        return ""
    trends = []
    for f in growth:
        rate = as_float(f.evidence.get("bytes_per_s"))
        match = next((fld for fld in fields if _finding_matches_field(f, fld)), None)
        if rate is None or match is None:
            continue
        last = next(((t, v[match]) for t, v in zip(reversed(ts), reversed(values), strict=False) if match in v), None)
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
    for _field, _match, rate, (lt, lv) in trends:
        y_hi = max(y_hi, lv + rate * (x_hi - lt), lv + rate * (ts[0] - lt))
        y_lo = min(y_lo, lv + rate * (ts[0] - lt))
    y_hi *= 1.05
    y_scale, y_unit = _byte_unit(max(abs(y_hi), abs(y_lo)))
    x_scale, x_unit = _time_unit(x_hi - x_lo)
    frame = _Frame(x_lo, x_hi, y_lo, y_hi, y_scale=y_scale, y_unit=y_unit, x_scale=x_scale, x_unit=x_unit)
    if len(ts) == 1:
        frame.x_label_override = f"time after trace start: {human_duration(ts[0])}"
    body: list[str] = []
    legend = []
    colours = {}
    for i, field in enumerate(fields):
        colour = PALETTE[i % len(PALETTE)]
        colours[field] = colour
        pts = [(frame.px(t), frame.py(v[field])) for t, v in zip(ts, values, strict=False) if field in v]
        if len(pts) > 1:
            body.append(_polyline(pts, colour))
        body.extend(_markers(pts, colour, limit=40 if len(pts) > 1 else 1))
        legend.append((colour, _class_name(field), ""))
    oom_lines = []
    for _field, _match, rate, (lt, lv) in trends:
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
        legend.append(("#111827", f"fitted trend of {_class_name(str(match or ''))} ({human_rate(rate)})", "dash"))
        oom = as_float(f.evidence.get("time_to_oom_s"))
        if oom is not None and oom > 0:
            oom_lines.append(
                f"{_class_name(str(match or ''))} grows {human_rate(rate)}: projected out of memory in {human_duration(oom)} after the last sample"
            )
        else:
            oom_lines.append(
                f"{_class_name(str(match or ''))} grows {human_rate(rate)} (no memory limit known to project an out-of-memory time)"
            )
    svg = _svg(frame, body, f"memory of {title}", f"memory ({y_unit})")
    n = len(entry.get("ts_us", []))
    sub = f"{_e(label)} · {n} sample{'s' if n != 1 else ''}" + (f" over {_e(human_duration(ts[-1] - ts[0]))}" if len(ts) > 1 else "")
    oom_html = "".join(f'<p class="oom">{_e(line)}</p>' for line in oom_lines)
    return f'<div class="plot"><h3>Memory by class — {_e(title)}</h3><div class="sub">{sub}</div>{svg}{_legend(legend)}{oom_html}</div>'


def with_leaked(entry: dict[str, Any], leaked: tuple[float, int] | None) -> list[dict[str, Any]]:
    """The samples, with the slots a census found leaked drawn as their own band. The ledger's
    counters count a leaked slot as owned (or unaccounted): only a census knows its request is
    gone. `leaked` is (the census's time, its orphans): samples from then on show them apart."""
    values = [dict(v) if isinstance(v, dict) else {} for v in entry.get("values", [])]
    if not leaked:
        return values
    since_us, orphans = leaked
    for ts, v in zip(entry.get("ts_us", []), values, strict=False):
        if ts < since_us:
            continue
        unaccounted = min(int(v.get("unaccounted_slots", 0) or 0), orphans)
        owned = min(int(v.get("owned_slots", 0) or 0), orphans - unaccounted)
        v["unaccounted_slots"] = int(v.get("unaccounted_slots", 0) or 0) - unaccounted
        v["owned_slots"] = int(v.get("owned_slots", 0) or 0) - owned
        v[LEAKED] = unaccounted + owned
    return values


def slots_plot(label: str, entry: dict[str, Any], t0_us: float, title: str, leaked: tuple[float, int] | None = None) -> str:
    ts = [(t - t0_us) / 1e6 for t in entry.get("ts_us", [])]
    values = with_leaked(entry, leaked)
    if not ts:
        return ""
    labels = {**SLOT_LABELS, "owned_slots": "owned by live requests"} if leaked else SLOT_LABELS
    layers = [
        k
        for k in ("free_slots", "owned_slots", "tree_slots", "unaccounted_slots", LEAKED)
        if any(v.get(k) for v in values) or k in ("free_slots", "owned_slots", "tree_slots")
    ]
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
        frame.x_label_override = f"time after trace start: {human_duration(ts[0])}"
    body: list[str] = []
    if single:
        # one sample: a stacked column at its time, labelled with the counts
        v = values[0]
        cx = frame.px(ts[0])
        half = 60
        below = 0.0
        for k in layers:
            n = float(v.get(k, 0) or 0)
            if n <= 0:
                continue
            y1, y0 = frame.py(below + n), frame.py(below)
            body.append(
                f'<rect x="{cx - half:.1f}" y="{y1:.1f}" width="{2 * half}" height="{max(y0 - y1, 0.5):.1f}" '
                f'fill="{SLOT_COLOURS[k]}" stroke="#ffffff" stroke-width="1"/>'
            )
            if y0 - y1 >= 14:
                body.append(
                    f'<text x="{cx:.1f}" y="{(y0 + y1) / 2 + 4:.1f}" font-size="11" fill="#1f2937" text-anchor="middle">'
                    f"{_e(labels[k])}: {int(n)}</text>"
                )
            below += n
    else:
        base = [0.0] * len(ts)
        for k in layers:
            top = [b + float(v.get(k, 0) or 0) for b, v in zip(base, values, strict=False)]
            upper = [(frame.px(t), frame.py(y)) for t, y in zip(ts, top, strict=False)]
            lower = [(frame.px(t), frame.py(y)) for t, y in zip(reversed(ts), reversed(base), strict=False)]
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in upper + lower)
            body.append(f'<polygon points="{pts}" fill="{SLOT_COLOURS[k]}" fill-opacity="0.9" stroke="none"/>')
            body.append(_polyline(upper, "#ffffff", width=0.8))
            base = top
    total_pts = [(frame.px(t), frame.py(tot)) for t, tot in zip(ts, totals, strict=False) if isinstance(tot, (int, float))]
    if total_pts:
        if single:
            x, y = total_pts[0]
            body.append(_polyline([(x - 80, y), (x + 80, y)], "#111827", width=1.4, dash="5 4"))
        else:
            body.append(_polyline(total_pts, "#111827", width=1.4, dash="5 4"))
    svg = _svg(frame, body, f"KV slots of {title}", "KV slots")
    last = values[-1]
    legend = [(SLOT_COLOURS[k], f"{labels[k]} {int(last.get(k, 0) or 0)}", "") for k in layers]
    if total_pts:
        legend.append(("#111827", f"total slots {int(totals[-1] or 0)}" if isinstance(totals[-1], (int, float)) else "total slots", "dash"))
    counts = ", ".join(f"{labels[k]} {int(last.get(k, 0) or 0)}" for k in layers)
    n = len(entry.get("ts_us", []))
    sub = (
        f"{_e(label)} · {n} sample{'s' if n != 1 else ''}"
        + (
            f" over {_e(human_duration(ts[-1] - ts[0]))}"
            if len(ts) > 1
            else f", the last at {_e(human_duration(ts[0]))}"
            if n > 1
            else f" at {_e(human_duration(ts[0]))}"
        )
        + f" · last: {_e(counts)}"
    )
    return f'<div class="plot"><h3>KV slot ledger — {_e(title)}</h3><div class="sub">{sub}</div>{svg}{_legend(legend)}</div>'
