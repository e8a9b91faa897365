"""The crash box on a device ledger: its counters, worst index and page bits in mapped host memory
(/dev/shm, registered with CUDA), written by the ledger's own kernels, read back from the file as
`kvdoctor run` reads it after a crash, and equal to what the ledger reads itself. Prints one JSON
line; `--cpu` runs the same on a host ledger.
"""

import json
import os
import shutil
import sys
import tempfile


def main() -> None:
    cpu = "--cpu" in sys.argv
    run_dir = tempfile.mkdtemp(prefix="kvdoctor-crash-box-check-")
    os.environ["KVDOCTOR_RENDEZVOUS"] = run_dir
    import torch

    from kvdoctor.delivery import crash_boxes
    from kvdoctor.probe.base.callsites import CallSites
    from kvdoctor.probe.ledgers.requests import RequestTable
    from kvdoctor.probe.ledgers.slots import SlotLedger

    device = "cpu" if cpu else "cuda:0"
    events = []
    sites = CallSites()
    ids = [sites.intern((name,), lambda name=name: name) for name in ("alloc", "free", "free again", "last_loc")]
    ledger = SlotLedger(
        name="check#0",
        size=1024,
        page_size=16,
        device=device,
        emit=lambda name, args: events.append(args),
        requests=RequestTable(),
        sites=sites,
    )
    out = {"device": device, "crash_box": ledger.crash_box_off or "on", "kernels": ledger.kernels is not None}
    pages = torch.arange(16, 48, device=device)  # two pages' slots
    ledger.on_alloc(pages, ids[0], only_page_starts=True)
    ledger.on_free(pages, ids[1], evicting=False)
    ledger.on_free(pages, ids[2], evicting=False)  # a double free: 32 slots
    ledger.check_last_loc(torch.tensor([5000], device=device), ids[3])  # past the buffer's 1040 rows
    if not cpu:
        torch.cuda.synchronize()
    own = [int(v) for v in ledger.xp.to_host(ledger.counters)]
    boxes = crash_boxes.collect(run_dir)
    box = boxes[0] if boxes else None
    out["ledger_counters"] = own
    out["box_counters"] = [int(v) for v in box["arrays"]["counters"]] if box else None
    recovered = crash_boxes.unreported(boxes, os.path.join(run_dir, "no-trace.json"))
    out["recovered"] = [{k: e.args.get(k) for k in ("kind", "count", "site", "bad_index", "slot_ids")} for e in recovered]
    out["emitted_here"] = len(events)
    print(json.dumps(out), flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
