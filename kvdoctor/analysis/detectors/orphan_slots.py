"""orphan_slots: slots neither free, nor in the tree, nor owned by a live request, at a census.

The census runs when the engine goes idle and at exit. The latest census of each allocator is the
verdict (a later census sees leaks an earlier one saw, unless the pool was cleared in between);
the largest count seen is kept in the evidence.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import as_list
from kvdoctor.analysis.findings import ERROR, Finding
from kvdoctor.trace import schema
from kvdoctor.units import as_count


class OrphanSlotsDetector:
    consumes = frozenset({schema.CENSUS})

    def __init__(self) -> None:
        self.latest: dict[tuple[int, str], dict[str, Any]] = {}  # (pid, allocator): its latest census
        self.max_seen: dict[tuple[int, str], int] = {}
        self.censuses = 0

    def feed(self, event: schema.Event) -> None:
        if event.name != schema.CENSUS:
            return
        self.censuses += 1
        key = (event.pid, str(event.args.get("allocator", "")))
        self.latest[key] = event.args
        self.max_seen[key] = max(self.max_seen.get(key, 0), as_count(event.args.get("orphan_slots")))

    def findings(self) -> list[Finding]:
        out = []
        for (pid, allocator), args in self.latest.items():
            count = as_count(args.get("orphan_slots"))
            if count:
                sites = args.get("orphan_allocated_at") if isinstance(args.get("orphan_allocated_at"), dict) else {}
                top_site = max(sites, key=lambda k: as_count(sites[k])) if isinstance(sites, dict) and sites else "unknown"
                reqs = args.get("orphan_requests") if isinstance(args.get("orphan_requests"), dict) else {}
                top_req = max(reqs, key=lambda k: as_count(reqs[k])) if isinstance(reqs, dict) and reqs else "unknown request"
                ids = as_list(args.get("orphan_slot_ids"))
                evidence = {
                    "allocator": allocator,
                    "census": args.get("reason"),
                    "idle": args.get("idle"),
                    "slot_ids": ids,
                    "allocated_at": sites,
                    "requests": reqs,
                    "max_orphan_slots_seen": self.max_seen.get((pid, allocator), count),
                    "free_slots": args.get("free_slots"),
                    "tree_slots": args.get("tree_slots"),
                    "total_slots": args.get("total_slots"),
                    "pid": pid,
                }
                shown = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
                if args.get("engine") == "vllm":
                    blocks = as_count(args.get("orphan_blocks"))
                    evidence["orphan_blocks"] = blocks
                    evidence["block_size"] = args.get("block_size")
                    message = (
                        f"{count} KV slot(s) leaked ({blocks} block(s) of {args.get('block_size')}): still referenced "
                        f"but held by no live request at the {args.get('reason', '')} census (slots {shown}); allocated "
                        f"by {top_site} for {top_req}, and their reference count never went back to 0"
                    )
                else:
                    message = (
                        f"{count} KV slot(s) leaked: neither free, nor in the radix tree, nor owned by a live request "
                        f"at the {args.get('reason', '')} census (slots {shown}); allocated by {top_site} for {top_req} "
                        f"and never freed or inserted. This is SGLang's 'memory leak detected ... diff={count}', with names"
                    )
                out.append(Finding(schema.ORPHAN_SLOTS, ERROR, message, count, evidence, pid))
            dangling = as_list(args.get("tree_holds_free_slot_ids"))
            freed = as_count(args.get("tree_freed_slots"))
            if freed:
                out.append(
                    Finding(
                        schema.TREE_HOLDS_FREE_SLOT,
                        ERROR,
                        f"the radix tree still holds {freed} slot(s) that were freed outside eviction "
                        f"(slots {', '.join(str(i) for i in dangling[:8])}); the next allocations hand them out twice",
                        freed,
                        {"allocator": allocator, "slot_ids": dangling, "pid": pid},
                        pid,
                    )
                )
        return out
