"""A trace's slot histories come from outside: whatever shape they have, reading, the report's
timeline and replay's search neither raise nor print a field unchecked."""

from __future__ import annotations

from kvdoctor.analysis.slot_history import clean_pages, find_slot, report_lines
from kvdoctor.trace import schema

GOOD = {
    "page": 4,
    "first_slot": 16,
    "page_size": 4,
    "entries": [
        {"op": "alloc", "site": "_prefill (w.py:1)", "row": None, "seq": 7, "thread": "MainThread", "ago_ms": 1500},
        {"op": "free", "site": "_finish (w.py:2)", "row": 3, "rid": "r3", "seq": 9, "thread": "MainThread", "ago_ms": 2},
    ],
}


def test_crafted_histories_read_as_nothing_or_as_unknown_fields():
    assert clean_pages("not a list") == [] and clean_pages([1, None, {"first_slot": "x"}]) == []
    (page,) = clean_pages([{"first_slot": 3, "entries": [{"op": 5, "row": [1], "rid": 7, "seq": "9", "ago_ms": 1.5}, "junk"]}])
    assert page["page_size"] == 1 and page["entries"] == [
        {"op": "?", "site": "", "row": None, "rid": "", "seq": None, "thread": "", "ago_ms": None}
    ]
    assert len(clean_pages([GOOD] * 100)) == 8  # bounded however many a trace holds


def test_the_report_prints_the_first_timeline_oldest_first_or_why_there_is_none():
    lines = report_lines({schema.SLOT_HISTORY: [GOOD, GOOD]}, "  ")
    assert lines[0] == "  history of slots 16-19 (page 4), oldest first (2 transition(s) kept):"
    assert "alloc" in lines[1] and "#7" in lines[1] and "1.500s before" in lines[1]
    assert "free" in lines[2] and "row 3 (rid r3) by _finish (w.py:2)" in lines[2]  # the request the row served then
    assert lines[3] == "  (histories of 1 more page(s) in the JSON report)"
    assert report_lines({schema.HISTORY_OFF: "the ledger lives on cuda:0"}, "") == ["no slot history: the ledger lives on cuda:0"]
    assert report_lines({}, "") == []


def test_replay_finds_a_slot_inside_a_page_of_a_violation_or_census():
    events = [
        schema.Event(ph="i", name=schema.VIOLATION, args={"kind": "double_free", schema.SLOT_HISTORY: [GOOD]}),
        schema.Event(ph="i", name=schema.CENSUS, args={schema.SLOT_HISTORY: "garbage"}),
        schema.Event(ph="i", name="kv_slots", args={schema.SLOT_HISTORY: [GOOD]}),
    ]
    assert [page["first_slot"] for _, page in find_slot(events, 19)] == [16]
    assert find_slot(events, 20) == []
