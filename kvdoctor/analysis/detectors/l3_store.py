"""l3_store_bytes: what HiCache's L3 store (the `mooncake` backend) holds for one process, page by
page, and whether it or something else explains that process's host memory growth.

sglang#19332 reports the scheduler's memory growing ~10 GB/h with the `file` and the `mooncake`
L3 backends alike. The probe's L3 ledger (`l3_keys`) counts the pages written, read back, never
read, and read without ever being written; a Mooncake client mounted in the scheduler keeps its
pages in a segment of fixed size there, so the store is bounded. The host-index views the tree
retains (`retained_views`) are not: when both are in one process, the finding names which one is
the growth.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.findings import INFO, WARNING, Finding
from kvdoctor.trace import schema
from kvdoctor.units import as_count, format_bytes

MIN_RETAINED_BYTES = 1 << 20


class L3StoreDetector:
    consumes = frozenset({schema.L3_KEYS, schema.RETAINED_VIEWS})

    def __init__(self) -> None:
        self.ledger: dict[int, dict[str, Any]] = {}
        self.retained: dict[int, dict[str, Any]] = {}

    def feed(self, event: schema.Event) -> None:
        if event.name == schema.L3_KEYS:
            self.ledger[event.pid] = event.args
        elif event.name == schema.RETAINED_VIEWS:
            self.retained[event.pid] = event.args

    def findings(self) -> list[Finding]:
        out = []
        for pid, args in self.ledger.items():
            written = as_count(args.get("keys_written"))
            read = as_count(args.get("keys_read"))
            never = max(written - read, 0)
            unwritten = as_count(args.get("reads_of_unwritten"))
            gone = as_count(args.get("read_misses_of_written"))
            page = as_count(args.get("page_bytes"))
            segment = as_count(args.get("segment_bytes"))
            asked = as_count(args.get("distinct_key_bytes"))
            raw_backends = args.get("backends")
            backends: dict[str, Any] = raw_backends if isinstance(raw_backends, dict) else {}
            backend = ", ".join(sorted(str(b) for b in backends)) or "the L3 store"
            held = min(asked, segment) if segment else asked
            share = f"{100 * never // written}%" if written else "0%"
            ledger = (
                f"{written} pages written ({format_bytes(asked, 1)}), {read} read back, {never} never read "
                f"({format_bytes(never * page, 1)}, {share}), {unwritten} reads of pages it never wrote, "
                f"{gone} written pages gone when read back"
            )
            for label, name in (("never read", "sample_unread_keys"), ("read but never written", "sample_unwritten_keys")):
                samples = args.get(name)
                if isinstance(samples, list) and samples:
                    ledger += f"; a key {label}: {str(samples[0])[:80]}"
            views = self.retained.get(pid, {})
            retained = as_count(views.get("retained_bytes"))
            if retained >= MIN_RETAINED_BYTES and retained > held:
                cause = (
                    f"Host memory grows because of sglang#19332, not the L3 store ({backend}): "
                    f"{as_count(views.get('long_lived_views'))} node.host_value views pin {format_bytes(retained, 1)} of old copies "
                    f"of HostKVCache's free list (alloc hands out views into free_slots, and with L3 on every prefetch frees the "
                    f"host slots it did not fill, so free_slots is rebuilt again and again), "
                    f"while the store holds at most {format_bytes(held, 1)}"
                    + (f" in its {format_bytes(segment, 1)} segment" if segment else "")
                    + ". "
                )
                severity = WARNING
            else:
                bound = f"at most its {format_bytes(segment, 1)} segment in this process" if segment else "what it was asked to keep"
                cause = f"The L3 store ({backend}) holds {format_bytes(held, 1)} for this process, bounded by {bound}. "
                severity = WARNING if unwritten or gone else INFO
            untracked = as_count(args.get("untracked_keys"))
            if untracked:
                ledger += (
                    f" ({untracked} more pages written past the ledger's {as_count(args.get('max_keys'))} keys: counts are lower bounds)"
                )
            message = cause + f"{backend} (HiCache L3): {ledger}"
            evidence = {
                key: args.get(key)
                for key in (
                    "keys_written",
                    "keys_read",
                    "keys_never_read",
                    "reads_of_unwritten",
                    "read_misses_of_written",
                    "set_pages",
                    "set_failed_pages",
                    "get_pages",
                    "get_hit_pages",
                    "get_miss_pages",
                    "exists_pages",
                    "exists_hit_pages",
                    "bytes_written",
                    "distinct_key_bytes",
                    "bytes_never_read",
                    "page_bytes",
                    "segment_bytes",
                    "untracked_keys",
                    "sample_unread_keys",
                    "sample_unwritten_keys",
                )
            }
            evidence.update({"backends": backends, "store_bytes_bound": held, "retained_bytes": retained, "pid": pid})
            out.append(Finding(schema.L3_STORE_BYTES, severity, message, never, evidence, pid, unit="pages"))
        return out
