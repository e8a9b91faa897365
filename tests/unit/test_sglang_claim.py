"""An orphan finding names SGLang's own 'memory leak detected ... diff=N' only where SGLang's numbers,
read in the same census, give that count: never on a busy census, a ledger that disagrees with
SGLang's free list, or sizes that add up to another diff."""

from __future__ import annotations

import pytest

from kvdoctor.analysis.detectors.orphan_slots import OrphanSlotsDetector
from kvdoctor.trace import schema

CLAIM = "This is SGLang's 'memory leak detected ... diff=64'"
AGREEING = {
    "allocator": "TokenToKVPoolAllocator#0",
    "reason": "idle",
    "idle": True,
    "total_slots": 2048,
    "host_free_slots": 128,
    "tree_evictable_slots": 1856,
    "tree_protected_slots": 0,
    "ledger_disagrees_slots": 0,
    "orphan_slots": 64,
    "orphan_slot_ids": list(range(817, 881)),
}


def _message(args: dict) -> str:
    detector = OrphanSlotsDetector()
    detector.feed(schema.Event(ph="i", name=schema.CENSUS, pid=1, ts=1.0, args=args))
    (finding,) = detector.findings()
    return finding.message


def test_the_claim_stands_where_sglangs_numbers_give_the_same_count():
    assert CLAIM in _message(AGREEING)


@pytest.mark.parametrize(
    "change",
    [
        {"idle": False, "reason": "rolling"},  # SGLang checks only when idle
        {"ledger_disagrees_slots": 3},  # the ledger and SGLang's free list differ
        {"tree_evictable_slots": 1800},  # SGLang's sizes add up to another diff
        {"host_free_slots": None},  # SGLang's free list was not read
    ],
)
def test_no_claim_where_sglangs_numbers_do_not_say_the_same(change):
    message = _message({**AGREEING, **change})
    assert "64 KV slot(s) leaked" in message and "memory leak detected" not in message
