"""double_free: a slot returned to the allocator while it was already free."""

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class DoubleFreeDetector(ViolationDetector):
    kind = schema.DOUBLE_FREE
    template = (
        "{count} KV slot(s) freed while already free{slots} by {site}; "
        "the allocator now lists them twice and will hand each to two requests"
    )
