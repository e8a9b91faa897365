"""The flight recorder's entries on Perfetto tracks (kvdoctor/probe/base/slot_tracks.py): one track a
page, only entries not written before, a bounded number of tracks, and nothing raised on args a
buggy caller made."""

from __future__ import annotations

from kvdoctor.probe.base.slot_tracks import FIRST_TRACK_TID, SlotTracks
from kvdoctor.trace import schema


def _event(pages, ts=10_000_000.0, kind="double_free"):
    return schema.Event(ph="i", name=schema.VIOLATION, pid=7, ts=ts, args={"kind": kind, "allocator": "pool", schema.SLOT_HISTORY: pages})


def _page(first, seqs, size=1):
    return {
        "page": first // size,
        "first_slot": first,
        "page_size": size,
        "entries": [{"op": "free", "seq": s, "ago_ms": 10 * (9 - s)} for s in seqs],
    }


def test_a_page_gets_one_named_track_and_each_entry_once_at_its_time():
    tracks = SlotTracks()
    first = tracks.events_for(_event([_page(32, [1, 2]), _page(64, [3], size=16)]))
    assert [(e.ph, e.name, e.tid) for e in first] == [
        ("M", schema.THREAD_NAME, FIRST_TRACK_TID),
        ("i", "free", FIRST_TRACK_TID),
        ("i", "free", FIRST_TRACK_TID),
        ("M", schema.THREAD_NAME, FIRST_TRACK_TID + 1),
        ("i", "free", FIRST_TRACK_TID + 1),
    ]
    assert first[0].args == {"name": "slot 32 (pool)"} and first[3].args == {"name": "slots 64-79 (pool)"}
    assert [e.ts for e in first if e.ph == "i"] == [10_000_000.0 - 80_000, 10_000_000.0 - 70_000, 10_000_000.0 - 60_000]
    assert first[1].cat == schema.CAT_HISTORY and first[1].to_json_dict()["s"] == "t"
    again = tracks.events_for(_event([_page(32, [1, 2, 5])], kind="census"))  # a census dumps it again, one entry newer
    assert [(e.name, e.args["seq"], e.args["dumped_by"]) for e in again] == [("free", 5, "census")]


def test_tracks_are_bounded_and_crafted_args_give_nothing():
    tracks = SlotTracks(max_tracks=2)
    assert len([e for e in tracks.events_for(_event([_page(n, [1]) for n in range(5)])) if e.ph == "M"]) == 2
    for pages in (None, "x", [1, None], [{"first_slot": "3", "entries": []}], [{"first_slot": 1, "entries": [None, {"seq": "2"}]}]):
        assert SlotTracks().events_for(_event(pages)) == []
    assert SlotTracks().events_for(schema.Event(ph="i", name="x", args=None)) == []  # type: ignore[arg-type]
