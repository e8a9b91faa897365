"""A finding's slot histories as swim-lanes in the HTML report: a lane a page, a marker a transition,
placed by the ledger's sequence number so that one order runs across the lanes (which slot moved
first), the op drawn on it and the whole entry as its tooltip."""

from __future__ import annotations

from typing import Any

from kvdoctor.formats.reports.html.svg import MARGIN_R, PALETTE, WIDTH
from kvdoctor.formats.reports.html.text import escape as _e

OP_COLOURS = {"alloc": "#2563eb", "owner": "#16a34a", "free": "#dc2626", "evict": "#ea580c", "tree": "#ca8a04", "last_loc": "#9333ea"}
LANE_H = 30
LANES_LEFT = 170


def history_lanes(pages: list[dict[str, Any]], describe: Any) -> str:
    """A finding's slot histories as swim-lanes: a lane a page, a marker a transition, placed by the
    ledger's sequence number (one order across the lanes: which slot moved first), the op above it and
    the whole entry (`describe(entry)`) as its tooltip. Pages as `analysis.slot_history.clean_pages`."""
    lanes = [p for p in pages if p["entries"]]
    if not lanes:
        return ""
    seqs = sorted({e["seq"] for p in lanes for e in p["entries"] if e["seq"] is not None})
    rank = {s: n for n, s in enumerate(seqs)}
    steps = max(len(seqs) - 1, 1)
    width, top = WIDTH, 20
    height = top + LANE_H * len(lanes) + 34
    span = width - LANES_LEFT - MARGIN_R - 30

    def x_of(entry: dict[str, Any], n: int, count: int) -> float:
        where = rank[entry["seq"]] / steps if entry["seq"] is not None else n / max(count - 1, 1)
        return LANES_LEFT + 15 + where * span

    body = []
    for i, page in enumerate(lanes):
        y = top + LANE_H * i + LANE_H / 2
        first, size = page["first_slot"], page["page_size"]
        name = f"slot {first}" if size == 1 else f"slots {first}-{first + size - 1}"
        body.append(f'<line x1="{LANES_LEFT}" y1="{y:.1f}" x2="{width - MARGIN_R}" y2="{y:.1f}" stroke="#e5e7eb"/>')
        body.append(f'<text x="{LANES_LEFT - 10}" y="{y + 4:.1f}" font-size="11" fill="#374151" text-anchor="end">{_e(name)}</text>')
        for n, entry in enumerate(page["entries"]):
            x, colour = x_of(entry, n, len(page["entries"])), OP_COLOURS.get(entry["op"], PALETTE[-1])
            label_y = y - 8 if n % 2 == 0 else y + 15  # neighbours alternate above and below
            body.append(
                f'<g class="transition"><title>{_e(describe(entry))}</title>'
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{colour}"/>'
                f'<text x="{x:.1f}" y="{label_y:.1f}" font-size="10" fill="{colour}" text-anchor="middle">{_e(entry["op"])}</text></g>'
            )
    axis = "transitions in the order the ledger recorded them (sequence number), oldest left; hover a marker for its site and time"
    body.append(f'<text x="{LANES_LEFT}" y="{height - 10}" font-size="11" fill="#6b7280">{_e(axis)}</text>')
    title = f"history of {len(lanes)} page(s), a lane each"
    return (
        f'<svg class="lanes" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" '
        f'role="img" aria-label="{_e(title)}" preserveAspectRatio="xMidYMid meet"><title>{_e(title)}</title>' + "".join(body) + "</svg>"
    )
