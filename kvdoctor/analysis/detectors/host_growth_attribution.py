"""host_growth_attribution: where in Python, and in which thread, host memory grew.

Reads the probe's `host_growth_sites` events (tracemalloc or memray windows, see
kvdoctor/probe/readings/attribution.py and attribution_memray.py) and reports the latest window of each process: the thread and
the file:line that gained the most. Info below `warn_bytes` over a window, warning above.
"""

from __future__ import annotations

from kvdoctor.analysis.findings import INFO, WARNING, Finding
from kvdoctor.trace import schema
from kvdoctor.units import MIB, as_int, format_bytes


class HostGrowthAttributionDetector:
    consumes = frozenset({schema.HOST_GROWTH_SITES})

    def __init__(self, *, min_bytes: int = 1 * MIB, warn_bytes: int = 64 * MIB) -> None:
        self.min_bytes = min_bytes
        self.warn_bytes = warn_bytes
        self.latest: dict[int, schema.Event] = {}
        self.windows: dict[int, int] = {}

    def feed(self, event: schema.Event) -> None:
        if event.name != schema.HOST_GROWTH_SITES:
            return
        self.latest[event.pid] = event
        self.windows[event.pid] = self.windows.get(event.pid, 0) + 1

    def findings(self) -> list[Finding]:
        out = []
        for pid, event in self.latest.items():
            args = event.args
            sites = [s for s in args.get("top_sites") or [] if isinstance(s, dict)]
            threads = [t for t in args.get("by_thread") or [] if isinstance(t, dict)]
            growth_bytes = as_int(args.get("growth_bytes"))
            if not sites or growth_bytes < self.min_bytes:
                continue
            top = max(sites, key=lambda s: as_int(s.get("size_diff_bytes")))
            thread = str(threads[0].get("thread")) if threads else str(top.get("thread") or "an unknown thread")
            window_s = args.get("window_s", "?")
            memray = args.get("engine") == "memray"
            seen = (
                "memray sees native allocations, torch CPU tensors included" if memray else "tracemalloc does not see torch tensor storage"
            )
            message = (
                f"host memory grows mostly in thread {thread} at {top.get('site', '?')} "
                f"(+{format_bytes(as_int(top.get('size_diff_bytes')), 1)} there, +{format_bytes(growth_bytes, 1)} "
                f"{'retained' if memray else 'traced'} in all, over the {window_s} s window) in pid {pid}; {seen}"
            )
            evidence = {
                "pid": pid,
                "window_index": args.get("window_index"),
                "windows": self.windows.get(pid, 0),
                "top_sites": sites[:5],
                "by_thread": threads[:5],
                "torch_tensors": args.get("torch_tensors"),
                "snapshots": args.get("snapshots"),
                "method": args.get("method"),
                "engine": args.get("engine", "tracemalloc"),
            }
            if memray:
                evidence["captures"] = args.get("captures")
            if args.get("memray_command"):
                evidence["memray_command"] = args["memray_command"]
            severity = WARNING if growth_bytes >= self.warn_bytes else INFO
            out.append(Finding(schema.HOST_GROWTH, severity, message, growth_bytes, evidence, pid, unit="bytes"))
        return out
