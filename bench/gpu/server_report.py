"""Merges the summaries of bench/gpu/run_server_suite.sh runs into one report (reports/gpu/<date>/):
a case run again later replaces the earlier result, and a correctness case whose trace is given
(a run's traces.tar.gz unpacked) is judged again by server_suite.judge as it is now.

    python3 bench/gpu/server_report.py OUT_DIR SUMMARY.json[:TRACES_DIR] ...

Writes OUT_DIR/summary.json and OUT_DIR/summary.md (server_suite's table and cost ratios)."""

from __future__ import annotations

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import server_suite


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    out, merged = sys.argv[1], {}
    for arg in sys.argv[2:]:
        path, _, traces = arg.partition(":")
        with open(path) as fh:
            summary = json.load(fh)
        for name, result in summary["cases"].items():
            case = server_suite.CASES.get(name)
            trace = os.path.join(traces, name, "sglang.kvtrace.json") if traces else ""
            if case is not None and case.kind != "cost" and trace and os.path.exists(trace):
                d = os.path.dirname(trace)
                fault = os.path.join(d, "fault.json")
                server = types.SimpleNamespace(
                    trace=trace,
                    workdir=d,
                    log_path=os.path.join(d, "server.log"),
                    fault=lambda f=fault: json.load(open(f)) if os.path.exists(f) else None,
                )
                result = {k: v for k, v in result.items() if k not in ("verdict", "why")}
                server_suite.judge(case, result, server)
                result["judged_again"] = True
            elif case is not None and case.kind == "cost" and trace and os.path.exists(trace) and case.probe:
                result["census"] = server_suite.censuses(trace)
            if result.get("verdict") == "pass" or name not in merged or merged[name].get("verdict") != "pass":
                merged[name] = result
    os.makedirs(out, exist_ok=True)
    summary = server_suite.write_summary(out, merged, False)
    print(server_suite.summary_md(summary["cases"], summary["cost"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
