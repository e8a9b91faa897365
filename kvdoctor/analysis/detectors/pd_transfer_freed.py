"""pd_transfer_freed_in_flight: a PD decode request's pages went back to the allocator after the decode
aborted its transfer and before the prefill acked that its writes drained, so the next request can be
handed pages the prefill's writer may still write (sglang#24527; SGLang up to 0.5.18, and up to 0.5.20
unless SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is on; PR#35049 holds them until the drain ack).

The probe's PD decode ledger (kvdoctor/probe/engines/sglang/pd_decode.py) follows each request of the
`DecodeTransferQueue` from the pages sent to the prefill to its row's release; its `pd_transfers`
events count the queue by `KVPoll` state.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector, as_list, first_request
from kvdoctor.trace import schema


class PdTransferFreedDetector(ViolationDetector):
    kind = schema.PD_TRANSFER_FREED_IN_FLIGHT
    unit = "pages"
    merged_counts = ("requests",)

    def feed(self, event: schema.Event) -> None:
        super().feed(event)
        group = self.groups.get((event.pid, str(event.args.get("allocator", "")), str(event.args.get("site", ""))))
        if group is not None and event.name == schema.VIOLATION and event.args.get("kind") == self.kind:
            merged = as_list(group["first"].get("page_ids")) + as_list(event.args.get("page_ids"))
            group["first"]["page_ids"] = list(dict.fromkeys(p for p in merged if isinstance(p, int)))[:64]

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        pages = as_list(evidence.get("page_ids"))
        shown = ", ".join(str(p) for p in pages[:8]) + (", ..." if len(pages) > 8 else "")
        which = f"pages {shown}" if pages else "pages not read (the request table is on a device)"
        return (
            f"{count} page(s) of a PD decode transfer freed while the prefill may still write them: request "
            f"{first_request(evidence)} (bootstrap room {evidence.get('room', '?')}, {which}) was aborted by the decode in "
            f"{evidence.get('state_at_abort') or '?'} and released at {site} {evidence.get('since_abort_s', '?')} s later, "
            f"{evidence.get('drain') or 'without a drain ack'}; the next request can be handed these pages and read the "
            f"aborted one's KV (sglang#24527: SGLang up to 0.5.18, and up to 0.5.20 by default; PR#35049 holds them until every "
            f"prefill rank acks its drain, SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE, on by default from 0.5.21)."
        )
