"""stale_last_loc: a `last_loc` that points at a slot its request no longer holds."""

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class StaleLastLocDetector(ViolationDetector):
    kind = schema.STALE_LAST_LOC
    template = (
        "{count} last_loc value(s) passed by {site} point at slots the request no longer holds{slots} ({request}); "
        "the new tokens continue a page that was freed or relocated after last_loc was read: "
        "re-read last_loc after any eviction or HiCache load"
    )
