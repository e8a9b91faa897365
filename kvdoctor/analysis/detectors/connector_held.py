"""connector_held_blocks: KV blocks a connector kept past the deadline after their request finished.

vLLM lets a KV connector keep a finished request's blocks until it reports the transfer done
(`finished_sending`), and keeps an aborted request's blocks while its remote load is pending
(`finished_recving`). The probe says when such a hold outlives the deadline (`connector_overdue`;
again at exit for those still held) and when an overdue one ends after all
(`connector_late_release`). These blocks are not orphans: a request still holds them, and vLLM
frees them the moment the connector reports. One finding per process, connector and reason: an
error while any is still held, a warning when every one was released late.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import as_list
from kvdoctor.analysis.findings import ERROR, WARNING, Finding
from kvdoctor.trace import schema
from kvdoctor.units import as_count, as_float

MAX_GROUPS = 256  # (process, connector, reason) groups; a trace naming more is crafted: the rest is dropped
MAX_REQUESTS = 4096  # requests remembered per connector and reason; past that, counted
NAMED_IN_MESSAGE = 4

# reason -> (why the blocks are still held, why they came back late)
WHY = {
    "connector_delayed_free": (
        "it kept them (request_finished delayed the free) and has not reported the request in finished_sending",
        "it kept them (request_finished delayed the free) and reported the request in finished_sending only past the deadline",
    ),
    "awaiting_remote_kv": (
        "the request was aborted while its remote KV load was pending, and the connector has not reported it in finished_recving",
        "the request was aborted while its remote KV load was pending, and the connector reported it in finished_recving only "
        "past the deadline",
    ),
    "ec_connector_delayed_free": (
        "the encoder-cache connector delayed the free and has not reported the request done",
        "the encoder-cache connector delayed the free and reported the request done only past the deadline",
    ),
}


class ConnectorHeldDetector:
    consumes = frozenset({schema.CONNECTOR_OVERDUE, schema.CONNECTOR_LATE_RELEASE})

    def __init__(self) -> None:
        self.groups: dict[tuple[int, str, str], dict[str, Any]] = {}  # (pid, holder, reason)

    def feed(self, event: schema.Event) -> None:
        args = event.args
        request = str(args.get("request", ""))
        key = (event.pid, str(args.get("holder", "KV connector")), str(args.get("reason", "")))
        group = self.groups.get(key)
        if group is None:
            if len(self.groups) >= MAX_GROUPS:
                return
            group = self.groups[key] = {"requests": {}, "untracked": 0}
        requests: dict[str, dict[str, Any]] = group["requests"]
        known = requests.get(request)
        if known is None:
            if len(requests) >= MAX_REQUESTS:
                group["untracked"] += 1
                return
            known = requests[request] = {}
        known.update(
            {
                "request": request,
                "blocks": as_count(args.get("blocks")),
                "block_ids": [b for b in as_list(args.get("block_ids")) if isinstance(b, int)][:64],
                "held_since": str(args.get("held_since", "")),
                "held_s": max(known.get("held_s", 0.0), as_float(args.get("held_s")) or 0.0),  # its age at the last word
                "deadline_s": as_float(args.get("deadline_s")) or 0.0,
                "status": str(args.get("status", "")),
                "released": known.get("released", False) or event.name == schema.CONNECTOR_LATE_RELEASE,
            }
        )

    def findings(self) -> list[Finding]:
        out = []
        for (pid, holder, reason), group in self.groups.items():
            # still held first, then the longest held
            requests = sorted(group["requests"].values(), key=lambda r: (r["released"], -r["held_s"], r["request"]))
            if not requests:
                continue
            held = [r for r in requests if not r["released"]]
            blocks = sum(r["blocks"] for r in requests)
            deadline = requests[0]["deadline_s"]
            first = requests[0]
            shown = ", ".join(str(b) for b in first["block_ids"][:8]) + (", ..." if len(first["block_ids"]) > 8 else "")
            others = [r["request"] for r in requests[1 : 1 + NAMED_IN_MESSAGE]]
            more = len(requests) - 1 - len(others) + group["untracked"]
            still, late = WHY.get(reason, (f"it kept them ({reason})", f"it kept them ({reason}) past the deadline"))
            kind = "encoder-cache connector" if reason == "ec_connector_delayed_free" else "KV connector"
            if held:
                verdict = f"{len(held)} still held" if len(held) < len(requests) else "never released"
                what = f"Request {first['request']} holds block(s) {shown or '?'} since {first['held_since']} ({first['held_s']:g} s)"
                tail = "Not orphans: vLLM frees them only when the connector reports the request done"
            else:
                verdict = "all released late"
                what = f"Request {first['request']} held block(s) {shown or '?'} from {first['held_since']} for {first['held_s']:g} s"
                tail = "vLLM freed them when the connector reported at last"
            message = (
                f"{blocks} KV block(s) of {len(requests) + group['untracked']} finished request(s) held by {kind} {holder} "
                f"past the {deadline:g} s deadline, {verdict}: {still if held else late}. {what}"
                + (f"; also {', '.join(others)}" if others else "")
                + (f" and {more} more" if more > 0 else "")
                + f". {tail}"
            )
            evidence = {
                "holder": holder,
                "reason": reason,
                "deadline_s": deadline,
                "blocks": blocks,
                "requests": {r["request"]: r["blocks"] for r in requests[:64]},  # request -> blocks held
                "holds": requests[:64],
                "still_held_requests": len(held),
                "untracked_requests": group["untracked"],
                "pid": pid,
            }
            out.append(Finding(schema.CONNECTOR_HELD_BLOCKS, ERROR if held else WARNING, message, blocks, evidence, pid, unit="blocks"))
        return out
