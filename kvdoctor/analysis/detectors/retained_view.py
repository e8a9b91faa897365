"""retained_view: long-lived index tensors that are small views into much larger arrays.

The probe reports, every few seconds, the host-index views still alive past a minimum age and
the distinct storage they keep alive. Growing retained bytes with a view-returning `alloc` is
sglang#19332: each `node.host_value` pins an old copy of the host pool's whole free list.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.findings import ERROR, WARNING, Finding
from kvdoctor.trace import schema
from kvdoctor.units import as_count, format_bytes

MIN_RETAINED_BYTES = 1 << 20
MIN_RATIO = 8


class RetainedViewDetector:
    consumes = frozenset({schema.RETAINED_VIEWS})

    def __init__(self) -> None:
        self.latest: dict[int, dict[str, Any]] = {}
        self.peak: dict[int, int] = {}
        self.first: dict[int, tuple[float, int]] = {}
        self.last_ts: dict[int, float] = {}

    def feed(self, event: schema.Event) -> None:
        if event.name != schema.RETAINED_VIEWS:
            return
        retained = as_count(event.args.get("retained_bytes"))
        self.latest[event.pid] = event.args
        self.peak[event.pid] = max(self.peak.get(event.pid, 0), retained)
        self.first.setdefault(event.pid, (event.ts, retained))
        self.last_ts[event.pid] = event.ts

    def findings(self) -> list[Finding]:
        out = []
        for pid, args in self.latest.items():
            retained = as_count(args.get("retained_bytes"))
            own = as_count(args.get("own_bytes"))
            views = as_count(args.get("long_lived_views"))
            if retained < MIN_RETAINED_BYTES or retained < MIN_RATIO * max(own, 1):
                continue
            storing = args.get("storing_sites") if isinstance(args.get("storing_sites"), dict) else {}
            alloc_sites = args.get("alloc_sites") if isinstance(args.get("alloc_sites"), dict) else {}
            where = (
                max(storing, key=lambda k: as_count(storing[k]))
                if storing
                else (max(alloc_sites, key=lambda k: as_count(alloc_sites[k])) if alloc_sites else "unknown")
            )
            t0, r0 = self.first[pid]
            span_s = max((self.last_ts[pid] - t0) / 1e6, 0.0)
            rate = (retained - r0) / span_s * 3600 if span_s > 1 else 0.0
            severity = ERROR if retained >= 64 * MIN_RETAINED_BYTES or rate > 0 else WARNING
            message = (
                f"{views} long-lived host-index tensors keep {format_bytes(retained, 1)} alive for {format_bytes(own, 1)} of indices "
                f"({as_count(args.get('distinct_storages'))} old copies of the host pool's free list); stored by {where}. "
                "This is sglang#19332: HostKVCache.alloc returns a view free_slots[:n], free() rebuilds free_slots with "
                "torch.cat, and every node.host_value pins an old copy. Clone the indices where they are stored "
                "(kvdoctor run --fix clone-host-indices) or upgrade SGLang"
            )
            evidence = {
                "retained_bytes": retained,
                "own_bytes": own,
                "long_lived_views": views,
                "distinct_storages": args.get("distinct_storages"),
                "storing_sites": storing,
                "alloc_sites": alloc_sites,
                "peak_retained_bytes": self.peak[pid],
                "retained_bytes_per_hour": round(rate),
                "pid": pid,
            }
            out.append(Finding(schema.RETAINED_VIEW, severity, message, views, evidence, pid, unit="tensors"))
        return out
