"""stale_last_loc: a `last_loc` that points at a slot its request no longer holds."""

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector, first_request, ids_text
from kvdoctor.trace import schema


class StaleLastLocDetector(ViolationDetector):
    kind = schema.STALE_LAST_LOC
    unit = "last_loc values"
    merged_counts = (*ViolationDetector.merged_counts, "last_loc_of")
    template = (
        "{count} last_loc value(s) passed by {site}{passed_for} point at slots the request no longer holds{slots} ({request}); "
        "the new tokens continue a page that was freed or relocated after last_loc was read: "
        "re-read last_loc after any eviction or HiCache load"
    )

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        """With the request that passed it where the probe knew it (`last_loc_of`: host ledgers, with
        the request rows the last_loc was read from)."""
        passers = evidence.get("last_loc_of")
        passed_for = f" for {', '.join(list(passers)[:3])}" if isinstance(passers, dict) and passers else ""
        return self.template.format(
            count=count, site=site, passed_for=passed_for, slots=ids_text(evidence), request=first_request(evidence)
        )
