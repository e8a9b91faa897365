"""double_alloc: a slot handed out while a request still owns it or the tree still holds it."""

from kvdoctor.trace import schema
from kvdoctor.analysis.detectors.base import ViolationDetector, ids_text


class DoubleAllocDetector(ViolationDetector):
    kind = schema.DOUBLE_ALLOC

    def message(self, count, allocator, site, evidence):
        return (
            f"{count} KV slot(s) allocated by {site} while still owned or held by the radix tree{ids_text(evidence)}; "
            "two users now write the same KV rows (look for an earlier double free or a free of tree-held slots)"
        )
