"""Which census the orphan verdict stands on: a rolling census names a slot only once it stayed
orphaned `persisted_s`, so one taken sooner after an idle census has not judged what that census
saw (a server killed 0.2 ms after both left a rolling 0 over an idle census's 32 orphans)."""

from __future__ import annotations

from kvdoctor.analysis.detectors.orphan_slots import OrphanSlotsDetector
from kvdoctor.trace import schema


def census(ts_s: float, reason: str, orphans: int) -> schema.Event:
    args = {"allocator": "PagedTokenToKVPoolAllocator#0", "reason": reason, "total_slots": 4096, "orphan_slots": orphans}
    args["orphan_slot_ids"] = list(range(688, 688 + orphans))
    if reason == "rolling":
        args["persisted_s"] = 5.0
    return schema.Event(ph="i", name=schema.CENSUS, pid=7, ts=ts_s * 1e6, args=args)


def verdict(*events: schema.Event) -> int:
    detector = OrphanSlotsDetector()
    for event in events:
        detector.feed(event)
    return sum(f.count for f in detector.findings() if f.kind == schema.ORPHAN_SLOTS)


def test_a_rolling_census_just_after_an_idle_one_does_not_clear_its_orphans():
    assert verdict(census(10.0, "idle", 32), census(10.0002, "rolling", 0)) == 32


def test_a_rolling_census_past_its_persistence_window_is_the_verdict():
    assert verdict(census(10.0, "idle", 32), census(16.0, "rolling", 0)) == 0  # the pool was cleared since
    assert verdict(census(10.0, "idle", 32), census(16.0, "rolling", 48)) == 48


def test_an_idle_census_after_a_rolling_one_is_the_verdict():
    assert verdict(census(10.0, "rolling", 16), census(10.1, "idle", 0)) == 0
    assert verdict(census(10.0, "rolling", 0), census(10.1, "rolling", 0), census(12.0, "idle", 32)) == 32
