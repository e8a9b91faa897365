"""A finding's slot histories in the HTML report as swim-lanes (kvdoctor/formats/reports/html/lanes.py):
a lane a page, a marker a transition in the ledger's order across lanes, the op on it and the whole
entry as its tooltip; nothing drawn for pages with no entries."""

from __future__ import annotations

import re

from kvdoctor.analysis.findings import Finding
from kvdoctor.analysis.slot_history import clean_pages, entry_line
from kvdoctor.formats.reports.html.lanes import history_lanes
from kvdoctor.formats.reports.html.page import finding_card

PAGES = [
    {
        "page": 5,
        "first_slot": 5,
        "page_size": 1,
        "entries": [
            {"op": "alloc", "site": "_prefill (w.py:10)", "row": 3, "seq": 10, "thread": "MainThread", "ago_ms": 40},
            {"op": "free", "site": "_finish (w.py:20)", "row": 3, "seq": 30, "thread": "MainThread", "ago_ms": 20},
            {"op": "free", "site": "_finish (w.py:21)", "row": 3, "seq": 40, "thread": "MainThread", "ago_ms": 0},
        ],
    },
    {
        "page": 2,
        "first_slot": 32,
        "page_size": 16,
        "entries": [{"op": "alloc", "site": "_prefill (w.py:10)", "row": 4, "seq": 20, "thread": "MainThread", "ago_ms": 30}],
    },
    {"page": 9, "first_slot": 9, "page_size": 1, "entries": []},
]


def _markers(svg: str) -> list[tuple[float, float, str]]:
    return [
        (float(x), float(y), op) for x, y, op in re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"[^>]*/><text[^>]*>([a-z_]+)</text>', svg)
    ]


def test_a_lane_a_page_and_one_order_across_the_lanes():
    svg = history_lanes(clean_pages(PAGES), entry_line)
    assert ">slot 5</text>" in svg and ">slots 32-47</text>" in svg and "slot 9" not in svg  # no lane for a page with nothing kept
    marks = _markers(svg)
    assert [op for _, _, op in marks] == ["alloc", "free", "free", "alloc"]
    first_lane, second_lane = marks[:3], marks[3:]
    assert len({y for _, y, _ in first_lane}) == 1 and second_lane[0][1] > first_lane[0][1]
    xs = {seq: x for seq, (x, _, _) in zip((10, 30, 40, 20), marks, strict=True)}
    assert xs[10] < xs[20] < xs[30] < xs[40]  # page 2's alloc (seq 20) between page 5's alloc and its first free
    assert svg.count("<title>") == 1 + 4 and "by _finish (w.py:21)" in svg  # each marker's tooltip is its whole entry


def test_the_card_draws_the_lanes_above_the_timeline_and_nothing_without_history():
    finding = Finding(kind="double_free", severity="error", message="m", count=1, evidence={"history": PAGES, "slot_ids": [5]})
    card = finding_card(finding, {})
    assert card.index('<svg class="lanes"') < card.index("history of slot 5, oldest first")
    assert history_lanes(clean_pages([]), entry_line) == "" and history_lanes(clean_pages("x"), entry_line) == ""
    assert '<svg class="lanes"' not in finding_card(Finding(kind="double_free", severity="error", message="m", count=1, evidence={}), {})
