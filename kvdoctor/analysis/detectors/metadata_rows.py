"""metadata_double_free, metadata_index_out_of_range, metadata_rows_leaked: SGLang's PD metadata buffer
rows (`ReqToMetadataIdxAllocator`), from the probe's metadata ledger
(kvdoctor/probe/engines/sglang/metadata_pool.py).

The allocator's `free` appends to its deque of free indices and checks nothing: an index freed twice
is handed to two requests, whose transfers then write one row of the metadata buffers. A row held
by no live request is named only by a census whose books balanced with the allocator's own
`free_slots`; the latest census of a pool that did not balance is a warning saying it cannot judge.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import MAX_LEDGER_ENTRIES, ViolationDetector, as_list
from kvdoctor.analysis.findings import WARNING, Finding
from kvdoctor.analysis.named import scalars
from kvdoctor.trace import schema
from kvdoctor.units import as_count


def indices_text(evidence: dict[str, Any], limit: int = 8) -> str:
    ids = as_list(evidence.get("slot_ids"))
    return ", ".join(str(i) for i in ids[:limit]) + (", ..." if len(ids) > limit else "") if ids else "?"


class MetadataDoubleFreeDetector(ViolationDetector):
    kind = schema.METADATA_DOUBLE_FREE
    unit = "indices"

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        return (
            f"{count} PD metadata buffer row index(es) of {allocator} freed while already free (index "
            f"{indices_text(evidence)}) by {site}, first freed by {evidence.get('first_free', '?')}: its free list "
            f"now holds the index twice and hands it to two requests, whose transfers write one metadata row"
        )


class MetadataIndexOutOfRangeDetector(ViolationDetector):
    kind = schema.METADATA_INDEX_OUT_OF_RANGE
    unit = "indices"

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        return (
            f"{count} index(es) outside {allocator}'s {as_count(evidence.get('pool_rows'))} metadata buffer rows freed "
            f"by {site} (index {indices_text(evidence)}): its free list now holds a row no metadata buffer has"
        )


class MetadataRowsLeakedDetector(ViolationDetector):
    kind = schema.METADATA_ROWS_LEAKED
    unit = "rows"
    consumes = frozenset({schema.VIOLATION, schema.METADATA_POOL})
    merged_counts = ("requests",)

    def __init__(self) -> None:
        super().__init__()
        self.last_census: dict[tuple[int, str], dict[str, Any]] = {}

    def feed(self, event: schema.Event) -> None:
        if event.name == schema.METADATA_POOL:
            key = (event.pid, str(event.args.get("pool", "")))
            if key in self.last_census or len(self.last_census) < MAX_LEDGER_ENTRIES:
                self.last_census[key] = scalars(event.args)
            return
        super().feed(event)

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        found = evidence.get("requests")
        requests: dict[str, Any] = found if isinstance(found, dict) else {}
        named = ", ".join(str(r) for r in list(requests)[:4]) + (", ..." if len(requests) > 4 else "")
        last = self.last_census.get((as_count(evidence.get("pid")), allocator))
        later = ""
        if last is not None and last.get("judged") is not False:
            later = (
                f" At the last census ({last.get('when')}) its {as_count(last.get('rows'))} rows were {as_count(last.get('free'))} "
                f"free, {as_count(last.get('held'))} held, {as_count(last.get('leaked'))} by no live request."
            )
        return (
            f"{count} PD metadata buffer row(s) of {allocator} leaked: index {indices_text(evidence)}, taken at {site} for "
            f"request {named or '?'}, is held by no live request ({evidence.get('why', '?')}) and was never freed; the "
            f"allocator has that many rows fewer for new transfers.{later}"
        )

    def findings(self) -> list[Finding]:
        out = super().findings()
        for (pid, pool), census in self.last_census.items():
            if census.get("judged") is False:
                reason = str(census.get("not_judged", ""))
                message = f"{pool}: PD metadata buffer rows not judged at the {census.get('when')} census in pid {pid}: {reason}"
                out.append(Finding(schema.PROBE_PARTIAL, WARNING, message, 0, {"reason": reason, "pool": pool, "pid": pid}, pid))
        return out
