"""Runs the real-SGLang workload cases under the probe and prints what the ledger ended with:
every ledger's arrays (hashed), the violation/census/status events in order, the hooked-call
count and the host's own results. Run once with KVDOCTOR_NATIVE=0 and once without, in fresh
interpreters, the two outputs must be equal: the native path changes nothing but the cost.

Each case also reports (native path only, left out of the comparison) how many calls of each
fast-path kind were taken in C, diverted to Python before the host call, or finished in Python.

argv[1]: JSON list of cases [page_size, fault, tree, fixes] (tree and fixes optional).
"""

import hashlib
import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

# Events whose content is decided on the scheduler's thread (the writer thread's timing differs
# between runs: its counters and rolling censuses are not compared).
COMPARED = {"violation", "census", "probe_status", "fix_applied"}
# statuses said from the writer thread, whenever it runs (the serving mark: the first round after a request)
WRITER_THREAD_COMPONENTS = {"memory_classes", "serving"}


def ledger_digest(ledger, site_names):
    """What a ledger holds, page by page, with call sites as text: site ids are per process and the
    native path interns a healthy free's site only when a violation needs it. The sink page (where
    out-of-range and mid-page slots are parked, never read) is left out."""
    body = slice(0, ledger.num_pages + 1)
    sites = [site_names[i] if 0 <= i < len(site_names) else f"?{i}" for i in ledger.alloc_site[body].tolist()]
    parts = {
        "state": bytes(memoryview(ledger.state[body])),
        "owner": bytes(memoryview(ledger.owner[body])),
        "alloc_site": "\n".join(sites).encode(),
        "flags": bytes(memoryview(ledger.flags)),
        "counters": bytes(memoryview(ledger.counters)),
    }
    if ledger.history is not None:  # the flight recorder: every word but the time, sites as text
        hist = ledger.history.hist
        named = [site_names[i] if 0 <= i < len(site_names) else f"?{i}" for i in hist[:, 1].tolist()]
        parts["history"] = bytes(memoryview(hist[:, [0, 2, 3]].copy())) + bytes(memoryview(ledger.history.head)) + "\n".join(named).encode()
    return {name: hashlib.sha256(data).hexdigest()[:16] for name, data in parts.items()}


def untimed(args):
    """An event's arguments without the flight recorder's times (the two runs' clocks differ)."""
    if isinstance(args.get("history"), list):
        args = dict(
            args, history=[dict(p, entries=[{k: v for k, v in e.items() if k != "ago_ms"} for e in p["entries"]]) for p in args["history"]]
        )
    return args


def main() -> None:
    cases = json.loads(sys.argv[1])
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    from kvdoctor.probe import native
    from kvdoctor.probe.core import runtime
    from kvdoctor.probe.engines.sglang.state import sglang_state
    from kvdoctor.trace.reader import iter_events

    out = []
    tmp = tempfile.mkdtemp()
    for case in cases:
        page_size, fault = case[0], case[1]
        tree = case[2] if len(case) > 2 else "radix"
        fixes = case[3] if len(case) > 3 else []
        path = os.path.join(tmp, f"{page_size}-{fault}-{tree}-{len(out)}.json")
        before = native.NATIVE.stats() if native.active() else {}
        probe = runtime.activate(path, fixes=fixes)
        result = run_workload(WorkloadConfig(page_size=page_size, fault=fault, tree=tree))
        state = sglang_state(probe)
        ledgers = {ledger.name: ledger_digest(ledger, probe.sites.names) for ledger in state.ledgers.values()}
        extent = hashlib.sha256(state.row_extent.tobytes()).hexdigest()[:16] if state.row_extent is not None else None
        calls, failures, ledger_on = probe.calls, probe.failures, probe.ledger_on
        after = native.NATIVE.stats() if native.active() else {}
        paths = {k: [a - b for a, b in zip(after[k], before[k], strict=True)] for k in ("fast", "diverted", "slow")} if after else {}
        runtime.deactivate()
        events = [
            {"name": e.name, "args": untimed(e.args)}
            for e in iter_events(path)
            if e.name in COMPARED and e.args.get("component") not in WRITER_THREAD_COMPONENTS
        ]
        out.append(
            {
                "case": case,
                "compiled": native.active(),
                "ledgers": ledgers,
                "row_extent": extent,
                "events": events,
                "calls": calls,
                "failures": failures,
                "ledger_on": ledger_on,
                "planted": result.planted,
                "digest": result.outputs_digest,
                "sglang_check": result.sglang_check,
                "paths": paths,
                # how the native path read tensors and keyed call sites (not compared)
                "readers": {k: after.get(k) for k in ("dlpack_reader", "direct_frames")},
            }
        )
    print("RESULT " + json.dumps(out, default=str))


if __name__ == "__main__":
    main()
