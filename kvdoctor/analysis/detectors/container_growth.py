"""container_growth: an engine container that grows with the requests served while live requests
do not (vllm#44490: `new_block_ids` appended at every allocation, drained only for Mamba models).

The probe walks the engine's containers every few seconds (`container_sizes`, probe/readings/containers.py).
A container is named when, over at least `MIN_SAMPLES` walks, it grew by `MIN_GROWTH` items or
more, never shrank, is at its largest at the last walk, and holds more than anything live could
explain: more than the pool's blocks (a block-keyed cache cannot outgrow the pool), more than
`LIVE_FACTOR` items per live request at the most, and more than `MIN_ITEMS`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvdoctor.analysis.findings import ERROR, Finding
from kvdoctor.trace import schema
from kvdoctor.units import as_count

MIN_SAMPLES = 4
MIN_GROWTH = 64
MIN_ITEMS = 128
LIVE_FACTOR = 4
MAX_TRACKED = 4096  # (process, root, path) series followed; the rest of a crafted trace is ignored

ENGINE_ISSUES = {"new_block_ids": "vllm#44490", "_cached_reqs_data": "vllm#17567"}


@dataclasses.dataclass
class _Series:
    first_ts: float
    first_items: int
    first_allocations: int
    last_ts: float
    last_items: int
    last_allocations: int
    peak_items: int
    samples: int = 1
    shrank: int = 0
    max_live: int = 0
    pool_blocks: int = 0


class ContainerGrowthDetector:
    consumes = frozenset({schema.CONTAINER_SIZES})

    def __init__(self) -> None:
        self.series: dict[tuple[int, str, str], _Series] = {}
        self.ignored = 0

    def feed(self, event: schema.Event) -> None:
        if event.name != schema.CONTAINER_SIZES:
            return
        args = event.args
        sizes = args.get("sizes")
        if not isinstance(sizes, dict):
            return
        root = str(args.get("root", ""))
        live = as_count(args.get("live_requests"))
        allocations = as_count(args.get("allocations"))
        blocks = as_count(args.get("pool_blocks"))
        for path, value in sizes.items():
            items = as_count(value)
            key = (event.pid, root, str(path))
            found = self.series.get(key)
            if found is None:
                if len(self.series) >= MAX_TRACKED:
                    self.ignored += 1
                    continue
                found = self.series[key] = _Series(event.ts, items, allocations, event.ts, items, allocations, items)
            else:
                found.samples += 1
                if items < found.last_items:
                    found.shrank += 1
                found.last_ts, found.last_items, found.last_allocations = event.ts, items, allocations
                found.peak_items = max(found.peak_items, items)
            found.max_live = max(found.max_live, live)
            found.pool_blocks = max(found.pool_blocks, blocks)

    def findings(self) -> list[Finding]:
        out = []
        for (pid, root, path), s in self.series.items():
            grown = s.last_items - s.first_items
            explained = max(s.pool_blocks, LIVE_FACTOR * s.max_live, MIN_ITEMS)
            if s.samples < MIN_SAMPLES or s.shrank or grown < MIN_GROWTH or s.last_items < s.peak_items or s.last_items <= explained:
                continue
            allocations = s.last_allocations - s.first_allocations
            span_s = max((s.last_ts - s.first_ts) / 1e6, 0.0)
            per_allocation = grown / allocations if allocations > 0 else None
            name = f"{root}.{path}" if root else path
            known = next((issue for attr, issue in ENGINE_ISSUES.items() if path.endswith(attr)), None)
            rate = f"+{per_allocation:.2f} per allocation" if per_allocation is not None else "with no allocation between"
            message = (
                f"{name} grew from {s.first_items:,} to {s.last_items:,} items ({rate}"
                + (f", +{grown / span_s:.1f}/s" if span_s > 0 else "")
                + f") and never shrank, while at most {s.max_live} request(s) were live"
                + (f" and the pool has {s.pool_blocks:,} blocks" if s.pool_blocks else "")
                + ": a container the engine appends to and never drains; host memory grows with every request served"
                + (f" ({known})" if known else "")
            )
            evidence: dict[str, Any] = {
                "pid": pid,
                "container": name,
                "items_first": s.first_items,
                "items_last": s.last_items,
                "growth_per_allocation": round(per_allocation, 4) if per_allocation is not None else None,
                "allocations": allocations,
                "span_s": round(span_s, 3),
                "max_live_requests": s.max_live,
                "pool_blocks": s.pool_blocks,
                "walks": s.samples,
            }
            if known:
                evidence["known_issue"] = known
            out.append(Finding(schema.CONTAINER_GROWTH, ERROR, message, grown, evidence, pid, unit="items"))
        return out
