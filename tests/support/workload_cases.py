"""Runs the real-SGLang workload for each (page_size, fault) case under the probe and prints JSON.

Run in a fresh interpreter so the SGLang version on sys.path (0.5.23 installed, or 0.5.9 put first
on PYTHONPATH) is the one the probe meets.
"""

import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    cases = json.loads(sys.argv[1])
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.demo.workload import WorkloadConfig, run_workload
    from kvdoctor.probe.core import runtime
    from kvdoctor.trace.reader import iter_events

    out = []
    tmp = tempfile.mkdtemp()
    for case in cases:
        page_size, fault = case[0], case[1]
        tree = case[2] if len(case) > 2 else "radix"
        path = os.path.join(tmp, f"{page_size}-{fault}-{tree}.json")
        probe = runtime.activate(path)
        result = run_workload(WorkloadConfig(page_size=page_size, fault=fault, tree=tree))
        version = probe.version_of("sglang")
        probe_map = probe.maps.get("sglang")
        map_source, ledgers_off, notes = getattr(probe_map, "source", None), sorted(probe.ledgers_off), dict(probe.map_notes)
        probe_on = probe.ledger_on
        runtime.deactivate()
        analysis = analyze(iter_events(path))
        out.append(
            {
                "page_size": page_size,
                "fault": fault,
                "tree": tree,
                "version": version,
                "map": map_source,
                "ledgers_off": ledgers_off,
                "map_notes": notes,
                "probe_on": probe_on,
                "planted": result.planted,
                "digest": result.outputs_digest,
                "sglang_check": result.sglang_check,
                "findings": [
                    {
                        "kind": f.kind,
                        "count": f.count,
                        "severity": f.severity,
                        "site": str(f.evidence.get("site", "")),
                        "evidence": f.evidence,
                    }
                    for f in analysis.findings
                ],
            }
        )
    print("RESULT " + json.dumps(out, default=str))


if __name__ == "__main__":
    main()
