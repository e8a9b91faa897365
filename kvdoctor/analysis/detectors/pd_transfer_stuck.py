"""pd_transfer_stuck: a PD decode transfer SGLang kept polling WaitingForInput or Transferring past the
deadline (`KVDOCTOR_PD_TRANSFER_DEADLINE_S`, 300 s by default): its row and pages stay held, and with
enough of them the decode admits no new request (sglang#9266; Mooncake's receiver times out only
WaitingForInput, so a transfer whose done signal never comes stays Transferring: PR#31800).
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector, first_request
from kvdoctor.analysis.findings import WARNING
from kvdoctor.trace import schema
from kvdoctor.units import as_count


class PdTransferStuckDetector(ViolationDetector):
    kind = schema.PD_TRANSFER_STUCK
    unit = "transfers"
    severity = WARNING
    merged_counts = ("requests",)

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        found = evidence.get("requests")
        requests = list(found) if isinstance(found, dict) else []
        others = f" and {len(requests) - 1} more" if len(requests) > 1 else ""
        return (
            f"{count} PD decode transfer(s) stuck in {allocator}: request {first_request(evidence)}{others} "
            f"(bootstrap room {evidence.get('room', '?')}, {as_count(evidence.get('page_count'))} page(s)) was still "
            f"{evidence.get('state') or '?'} {evidence.get('age_s', '?')} s after its pages were sent to the prefill "
            f"(deadline {evidence.get('deadline_s', '?')} s); its row and pages stay held until it ends (sglang#9266, PR#31800)."
        )
