"""Tree misuse: slots inserted into the radix tree after being freed, and lock-ref underflows."""

from kvdoctor.trace import schema
from kvdoctor.analysis.detectors.base import ViolationDetector, ids_text


class UseAfterFreeDetector(ViolationDetector):
    kind = schema.USE_AFTER_FREE

    def message(self, count, allocator, site, evidence):
        return f"{count} freed KV slot(s) inserted into the radix tree by {site}{ids_text(evidence)}; the tree now serves freed memory as a prefix"


class LockUnderflowDetector(ViolationDetector):
    kind = schema.LOCK_UNDERFLOW

    def message(self, count, allocator, site, evidence):
        return f"{count} dec_lock_ref call(s) on unlocked tree nodes by {site}; their slots can be evicted while still in use"
