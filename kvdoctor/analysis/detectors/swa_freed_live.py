"""swa_slot_freed_live: SGLang's `SWATokenToKVPoolAllocator` freed a live sliding-window slot: a free
of full slots' SWA side, deferred in a free group, read the full-to-SWA mapping only at the group's
end, after an insert had re-pointed the full slot at another request's SWA slot (sglang#36081:
SGLang 0.5.18's `free_swa` and a tombstone recovery, `RecoverSWAWithLockedFull`, in one group).

The probe's SWA ledger (kvdoctor/probe/engines/sglang/swa_pool.py) keeps what each deferred free asked for
and, when the group's end runs them, names the slots it freed that nobody asked to free, with the
full slot that mapped to each, the slot the free had asked for, and who re-pointed the mapping.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector, as_list
from kvdoctor.trace import schema


class SwaFreedLiveDetector(ViolationDetector):
    kind = schema.SWA_SLOT_FREED_LIVE
    unit = "slots"
    merged_counts = ("requests",)

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        def shown(key: str) -> str:
            ids = as_list(evidence.get(key))
            return ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "") or "?"

        found = evidence.get("requests")
        requests = ", ".join(str(r) for r in list(found)[:4]) if isinstance(found, dict) and found else ""
        remapped = str(evidence.get("remapped_at") or "")
        by = f" by {remapped}" + (f" (request {requests})" if requests else "") if remapped else " by a write the probe did not see"
        return (
            f"{count} live SWA slot(s) of {allocator} freed: SWA slot {shown('slot_ids')}, mapped from full slot "
            f"{shown('full_slot_ids')}, freed by {evidence.get('path') or 'a deferred free'}; the free was asked at {site} "
            f"for SWA slot {shown('asked_slot_ids')}, and the full slot was re-pointed{by} before the group ended. The "
            f"slot is free while the tree or a request still uses it (use after free), and the slot asked for is freed by "
            f"nothing (sglang#36081: SGLang 0.5.18's free_swa reads the mapping at the group's end, and a tombstone "
            f"recovery in the same group re-points it; 0.5.19 reads it at the call)."
        )
