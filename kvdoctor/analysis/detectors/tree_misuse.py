"""Tree misuse: slots inserted into the radix tree after being freed, and lock-ref underflows."""

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class UseAfterFreeDetector(ViolationDetector):
    kind = schema.USE_AFTER_FREE
    unit = "slots"
    paged = True
    template = "{count} freed KV slot(s) inserted into the radix tree by {site}{slots}; the tree now serves freed memory as a prefix"


class LockUnderflowDetector(ViolationDetector):
    kind = schema.LOCK_UNDERFLOW
    unit = "calls"
    template = "{count} dec_lock_ref call(s) on unlocked tree nodes by {site}; their slots can be evicted while still in use"
