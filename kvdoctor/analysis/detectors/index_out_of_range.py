"""index_out_of_range: a slot index outside the KV buffer (an illegal memory access on a GPU)."""

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class IndexOutOfRangeDetector(ViolationDetector):
    kind = schema.INDEX_OUT_OF_RANGE

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        rows = evidence.get("valid_rows") or ["?", "?"]
        return (
            f"{count} slot index(es) outside the KV buffer reached {site} (worst {evidence.get('bad_index')}, "
            f"valid rows {rows[0]}..{rows[-1]}, -1 only as 'no prefix'); on a GPU this is an illegal memory access"
        )
