"""double_free: a slot returned to the allocator while it was already free."""

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class DoubleFreeDetector(ViolationDetector):
    kind = schema.DOUBLE_FREE
    unit = "slots"
    paged = True
    template = (
        "{count} KV slot(s) freed while already free{slots} by {site}; "
        "the allocator now lists them twice and will hand each to two requests"
    )

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        """The template, and where the probe named the release path it happened in (a preemption
        giving back a request already released), that path, its step and the request."""
        text = super().message(count, allocator, site, evidence)
        queued = evidence.get("queued_for_release_at")
        if isinstance(queued, dict) and evidence.get("why") == "queued for release while already queued":
            first = ", ".join(str(k) for k in list(queued)[:3]) or "an earlier call"
            text += f"; a host pool's release queue took them twice: first from {first}, again from {site}"
        path = evidence.get("path")
        if not isinstance(path, str) or not path:
            return text
        step = evidence.get("forward_ct")
        where = f" at forward {step}" if isinstance(step, int) and not isinstance(step, bool) else ""
        released = evidence.get("released_request")
        after = f", after it gave back {released}" if isinstance(released, str) and released else ""
        return f"{text}; inside {path}{where}{after}"
