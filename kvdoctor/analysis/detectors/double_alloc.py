"""double_alloc: a slot handed out while a request still owns it or the tree still holds it."""

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class DoubleAllocDetector(ViolationDetector):
    kind = schema.DOUBLE_ALLOC
    unit = "slots"
    paged = True
    template = (
        "{count} KV slot(s) allocated by {site} while still owned or held by the radix tree{slots}; "
        "two users now write the same KV rows (look for an earlier double free or a free of tree-held slots)"
    )
