"""mm_features_held: finished requests' multimodal feature tensors (pixel values, audio features)
still alive after the result that finished them was processed (sglang#7340, #8429, #8902: VLM GPU
memory grows until OOM; SGLang up to 0.5.7).

The probe's multimodal inputs ledger (kvdoctor/probe/engines/sglang/mm_inputs.py) notes, once
`Scheduler.process_batch_result` returned, each finished request that still holds a feature tensor,
and says in `mm_inputs` events which of them are still alive at a later count (the next processed
result, the writer thread's round, exit). One finding per process: an error while any is held at the
last count, a warning when all were released later.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import as_list
from kvdoctor.analysis.findings import ERROR, WARNING, Finding
from kvdoctor.trace import schema
from kvdoctor.units import as_count, as_float

MAX_PROCESSES = 256  # processes one analysis names; a trace naming more is crafted: the rest is dropped
MAX_REQUESTS = 4096  # requests remembered per process; past that, counted
NAMED_IN_MESSAGE = 4
MAX_BYTES = 1 << 62  # one request's feature bytes as read; a trace saying more is crafted


def mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n} bytes"


class MmFeaturesHeldDetector:
    consumes = frozenset({schema.MM_INPUTS})

    def __init__(self) -> None:
        self.processes: dict[int, dict[str, Any]] = {}

    def feed(self, event: schema.Event) -> None:
        args = event.args
        proc = self.processes.get(event.pid)
        if proc is None:
            if len(self.processes) >= MAX_PROCESSES:
                return
            proc = self.processes[event.pid] = {"requests": {}, "untracked": 0, "last": {}}
        proc["last"] = {k: args.get(k) for k in ("scheduler", "when")}  # what the message reads, not the whole event
        proc["untracked"] = max(proc["untracked"], as_count(args.get("untracked_requests")))
        requests: dict[str, dict[str, Any]] = proc["requests"]
        listed = [h for h in as_list(args.get("held")) if isinstance(h, dict)]
        for rid in as_list(args.get("released")):  # named before, their tensors gone since
            known = requests.get(str(rid))
            if known is not None:
                known["released"] = True
        for hold in listed:
            rid = str(hold.get("rid", ""))
            known = requests.get(rid)
            if known is None:
                if len(requests) >= MAX_REQUESTS:
                    proc["untracked"] += 1
                    continue
                known = requests[rid] = {"rid": rid, "bytes": 0, "held_s": 0.0, "results_since_finish": 0}
            known.update(
                {
                    "bytes": max(known["bytes"], min(as_count(hold.get("bytes")), MAX_BYTES)),
                    "device": str(hold.get("device", "?")),
                    "items": as_count(hold.get("items")),
                    "held_s": max(known["held_s"], as_float(hold.get("held_s")) or 0.0),
                    "results_since_finish": max(known["results_since_finish"], as_count(hold.get("results_since_finish"))),
                    "request_alive": hold.get("request_alive"),
                    "last_seen": str(args.get("when", "?")),
                    "released": False,
                }
            )

    def findings(self) -> list[Finding]:
        out = []
        for pid, proc in self.processes.items():
            requests = sorted(proc["requests"].values(), key=lambda r: (r["released"], -r["bytes"], r["rid"]))
            if not requests:
                continue
            held = [r for r in requests if not r["released"]]
            total = sum(r["bytes"] for r in requests)
            still = sum(r["bytes"] for r in held)
            devices = sorted({r["device"] for r in requests})
            first = requests[0]
            others = [r["rid"] for r in requests[1 : 1 + NAMED_IN_MESSAGE]]
            more = len(requests) - 1 - len(others) + proc["untracked"]
            last = proc["last"]
            scheduler = str(last.get("scheduler", "Scheduler"))
            alive = first.get("request_alive")
            if alive is True:
                whose = "the request object itself is still alive"
            elif alive is False:
                whose = "the request object is gone: something else keeps them, such as a batch's multimodal_inputs list"
            else:
                whose = "whether the request object is still alive was not read"
            if held:
                verdict = f"{mib(still)} in {len(held)} request(s) still held at the last count ({last.get('when', '?')})"
            else:
                verdict = "all released later"
            message = (
                f"{mib(total)} of multimodal feature tensors (pixel values/audio features) on {', '.join(devices)} kept by "
                f"{len(requests) + proc['untracked']} finished request(s) after {scheduler}.process_batch_result finished them, {verdict}. "
                f"Request {first['rid']} holds {mib(first['bytes'])} in {first['items']} item(s) on {first['device']}, "
                f"{first['results_since_finish']} result(s) and {first['held_s']:g} s after its finish ({whose})"
                + (f"; also {', '.join(others)}" if others else "")
                + (f" and {more} more" if more > 0 else "")
                + ". This release's result processing never drops a finished request's features: a VLM server's GPU memory "
                "grows with every image request until OOM (sglang#7340, #8429, #8902; fixed in SGLang 0.5.8 by "
                "Scheduler._maybe_clear_mm_inputs, PR#17324, which sets item.feature and req.multimodal_inputs to None at finish)."
            )
            evidence = {
                "scheduler": scheduler,
                "bytes": total,
                "still_held_bytes": still,
                "devices": devices,
                "requests": {r["rid"]: r["bytes"] for r in requests[:64]},  # rid -> feature bytes
                "holds": requests[:64],
                "still_held_requests": len(held),
                "untracked_requests": proc["untracked"],
                "last_count": str(last.get("when", "?")),
                "pid": pid,
            }
            out.append(
                Finding(
                    schema.MM_FEATURES_HELD,
                    ERROR if held else WARNING,
                    message,
                    len(requests) + proc["untracked"],
                    evidence,
                    pid,
                    unit="requests",
                )
            )
        return out
