"""Runs demo workloads under the probe and prints the slot histories their trace holds: each
violation's and census's `history` (times left out: two runs' clocks differ), in trace order, and
what each request row's table says of it at the end (its owner now, beside the owner an entry names).

argv[1]: JSON list of [page_size, fault]. Run with KVDOCTOR_NATIVE=0 and =1 (the two must agree).
"""

import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    from kvdoctor.probe import native
    from kvdoctor.probe.core import runtime
    from kvdoctor.trace.reader import iter_events

    out = []
    tmp = tempfile.mkdtemp()
    for page_size, fault in json.loads(sys.argv[1]):
        path = os.path.join(tmp, f"{page_size}-{fault}.json")
        probe = runtime.activate(path)
        from kvdoctor.probe.engines.sglang.state import sglang_state

        run_workload(WorkloadConfig(page_size=page_size, fault=fault))
        state = sglang_state(probe)
        rows = {ledger.name: ledger.history.entries if ledger.history is not None else 0 for ledger in state.ledgers.values()}
        rows_now = {str(row): state.requests.describe(row) for row in state.requests.owners}  # each row's owner at the end
        runtime.deactivate()
        found = []
        for e in iter_events(path):
            if e.name not in ("violation", "census"):
                continue
            pages = [
                dict(p, entries=[{k: v for k, v in x.items() if k != "ago_ms"} for x in p["entries"]]) for p in e.args.get("history", [])
            ]
            found.append(
                {
                    "name": e.name,
                    "kind": e.args.get("kind", e.args.get("reason")),
                    "history": pages,
                    "off": e.args.get("history_off"),
                    "unchanged": e.args.get("history_unchanged", False),
                }
            )
        out.append({"case": [page_size, fault], "compiled": native.active(), "events": found, "entries": rows, "rows_now": rows_now})
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
