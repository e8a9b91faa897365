"""double_free: a slot returned to the allocator while it was already free."""

from kvdoctor.trace import schema
from kvdoctor.analysis.detectors.base import ViolationDetector, ids_text


class DoubleFreeDetector(ViolationDetector):
    kind = schema.DOUBLE_FREE

    def message(self, count, allocator, site, evidence):
        return (
            f"{count} KV slot(s) freed while already free{ids_text(evidence)} by {site}; "
            "the allocator now lists them twice and will hand each to two requests"
        )
