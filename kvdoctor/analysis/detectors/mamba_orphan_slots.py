"""mamba_orphan_slots: Mamba state slots of SGLang's `MambaPool` held by no request, row or tree node
(sglang#15840: up to 0.5.9 a copy-on-write slot stays with a request `PrefillAdder.add_one_req`
refused, and is lost when the waiting request is dropped without releasing it; from 0.5.20, any slot
a release did not give back).

The probe's Mamba ledger (kvdoctor/probe/engines/sglang/mamba_pool.py) takes a census of the pool after each
prefill pick: free, tree, rows, waiting and running holders. A slot unaccounted at two censuses in a
row is named with the request that last held it and the path that took it; waiting-queue holders are
counted (`mamba_pool` events), never named. From 0.5.20 (mamba_slots.py) the census runs when the
engine is quiet, no request live: free, the tree's Mamba values and sessions' records hold every
slot; its events carry `quiet`.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector, as_list
from kvdoctor.analysis.named import scalars
from kvdoctor.trace import schema
from kvdoctor.units import as_count


class MambaOrphanSlotsDetector(ViolationDetector):
    kind = schema.MAMBA_ORPHAN_SLOTS
    unit = "slots"
    consumes = frozenset({schema.VIOLATION, schema.MAMBA_POOL})
    merged_counts = ("requests",)

    def __init__(self) -> None:
        super().__init__()
        self.last_count: dict[int, dict[str, Any]] = {}

    def feed(self, event: schema.Event) -> None:
        if event.name == schema.MAMBA_POOL:
            if event.pid in self.last_count or len(self.last_count) < 1024:
                self.last_count[event.pid] = scalars(event.args)  # the counts the message reads, not the holders' lists
            return
        super().feed(event)

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        found = evidence.get("requests")
        requests: dict[str, Any] = found if isinstance(found, dict) else {}
        named = ", ".join(str(r) for r in list(requests)[:4]) + (", ..." if len(requests) > 4 else "")
        slots = ", ".join(str(s) for s in as_list(evidence.get("slot_ids"))[:8])
        path = str(evidence.get("path") or "a path the probe did not see")
        last = self.last_count.get(as_count(evidence.get("pid")))
        if evidence.get("quiet") is True:
            return self.quiet_message(count, allocator, site, slots, named, last)
        later = ""
        if last is not None:
            later = (
                f" At the last census the pool's {as_count(last.get('slots'))} slots were {as_count(last.get('free'))} free, "
                f"{as_count(last.get('tree'))} in the tree, {as_count(last.get('request_rows'))} in request rows, "
                f"{as_count(last.get('waiting_holders'))} held by waiting requests, {as_count(last.get('unaccounted'))} unaccounted."
            )
        return (
            f"{count} Mamba state slot(s) of {allocator} orphaned: slot {slots or '?'}, last held by request {named or '?'}, "
            f"taken by {path} at {site}, is not free, in no request's row, no live request's mamba_pool_idx and no tree node "
            f"(sglang#15840: up to SGLang 0.5.9 a copy-on-write slot stays with a request add_one_req refused, and is lost "
            f"when the waiting request is dropped; fixed in 0.5.10 by freeing it at the refusal, sglang PR#16067).{later}"
        )

    @staticmethod
    def quiet_message(count: int, allocator: str, site: str, slots: str, named: str, last: dict[str, Any] | None) -> str:
        """A slot found at two quiet censuses in a row (SGLang 0.5.20 on): no request was live."""
        later = ""
        if last is not None:
            later = (
                f" At the last census the pool's {as_count(last.get('slots'))} slots were {as_count(last.get('free'))} free, "
                f"{as_count(last.get('tree'))} in the tree, {as_count(last.get('session_holders'))} held by sessions, "
                f"{as_count(last.get('unaccounted'))} unaccounted."
            )
        return (
            f"{count} Mamba state slot(s) of {allocator} orphaned: slot {slots or '?'}, last taken by request {named or '?'} "
            f"at {site}; with no request live it is not free, in no tree node and in no session's record, at two quiet "
            f"censuses in a row whose free list and tree matched SGLang's own counts: a release did not give it back "
            f"(HybridReqToTokenPool.free_mamba_cache, or the tree's insert, never took it).{later}"
        )
