"""stale_last_loc: a `last_loc` that points at a slot its request no longer holds."""

from kvdoctor.trace import schema
from kvdoctor.analysis.detectors.base import ViolationDetector, first_request, ids_text


class StaleLastLocDetector(ViolationDetector):
    kind = schema.STALE_LAST_LOC

    def message(self, count, allocator, site, evidence):
        return (
            f"{count} last_loc value(s) passed by {site} point at slots the request no longer holds"
            f"{ids_text(evidence)} ({first_request(evidence)}); the new tokens continue a page that was freed "
            "or relocated after last_loc was read: re-read last_loc after any eviction or HiCache load"
        )
