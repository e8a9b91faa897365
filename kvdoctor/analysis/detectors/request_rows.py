"""request_rows_leaked: rows of SGLang's request pool (`req_to_token_pool`) whose request is gone, or
names no row now, while no free of the row was seen (kvdoctor/probe/engines/sglang/left_rows.py).

A row left this way is one request fewer the server can run at once; SGLang's own idle check says
"req_to_token_pool memory leak detected!" and no more. The probe names the row and the request that
held it; what the row still pointed at is the slot ledger's (an `orphan_slots` finding, if any).
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector, as_list
from kvdoctor.trace import schema


class RequestRowsLeakedDetector(ViolationDetector):
    kind = schema.REQUEST_ROWS_LEAKED
    unit = "rows"
    merged_counts = ("requests",)

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        found = evidence.get("requests")
        requests = list(found) if isinstance(found, dict) else []
        named = ", ".join(str(r) for r in requests[:4]) + (", ..." if len(requests) > 4 else "")
        if not named:
            named = "row " + ", ".join(str(r) for r in as_list(evidence.get("slot_ids"))[:8])
        return (
            f"{count} request row(s) of {allocator or 'the request pool'} leaked: {named} was {site}, and "
            f"{evidence.get('why', '?')}; the pool has that many rows fewer for running requests"
        )
