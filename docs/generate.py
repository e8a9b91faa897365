"""Regenerates the parts of the docs (and the README) that are made from the tree's own data.

    .venv/bin/python docs/generate.py           # rewrite every generated part
    .venv/bin/python docs/generate.py --check   # exit 1 naming the files that are stale

What is generated:
- a block between `<!-- generated: KEY -->` and `<!-- end generated -->` in a page, by its KEY:
  `probes-table` (`kvdoctor probes --table`, from probes/), `output-formats` (every output, from
  kvdoctor/formats/table.py), `bench-cpu`, `bench-instructions`,
  `bench-vllm` (bench/results/*.json), `bench-gpu` (reports/gpu/results.json), and
  `finding REPORT KIND` (the KIND finding's lines of a committed report, e.g. reports/demo/leak.txt)
  and `report REPORT` (a committed text report but its first line);
- docs/gpu.md whole, from reports/gpu/SUMMARY.md (its links to files of the tree become paths).

tests/unit/test_docs_generated.py runs the check, so a page that no longer says what its data says
fails CI; bench/run_all.py runs this script after it writes bench/results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import posixpath
import re
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES_WITH_BLOCKS = ["README.md", *(f"docs/{name}" for name in ("index.md", "findings.md", "supported.md", "benchmarks.md", "usage.md"))]
BLOCK = re.compile(r"(<!-- generated: (?P<key>[^>]+?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)
HEADLINE = re.compile(r"^(ERROR|warn|info) +([a-z0-9_]+?):?(?: |$)")  # formats/reports/terminal.py's marks
GPU_RESULTS = "reports/gpu/results.json"
GPU_SUMMARY = "reports/gpu/SUMMARY.md"


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
        return fh.read()


def _json(rel: str) -> dict:
    return json.loads(_read(rel))


def _run_all():  # bench/run_all.py's table(), the one table format for the CPU figures
    spec = importlib.util.spec_from_file_location("kvdoctor_bench_run_all", os.path.join(ROOT, "bench", "run_all.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probes_table() -> str:
    sys.path.insert(0, ROOT)
    from kvdoctor.runner.support import markdown_table
    from kvdoctor.trace.schema import SERVING_ENGINES

    return "\n\n".join(markdown_table(engine) for engine in SERVING_ENGINES)


def output_formats() -> str:
    sys.path.insert(0, ROOT)
    from kvdoctor.formats.table import markdown_table

    return markdown_table()


def _results(prefix: str) -> list[str]:
    """bench/results files of one kind, by name: `<machine>.json` from bench/run (prefix ""),
    `instructions-*.json`, `vllm-*.json`, `slot-history-*.json` (bench/bench_slot_history.py's, quoted
    where the flight recorder is described), `request-pools-*.json` (bench/bench_request_pools.py's)."""
    folder = os.path.join(ROOT, "bench", "results")
    kinds = ("instructions-", "vllm-", "slot-history-", "request-pools-")
    names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    if prefix:
        return [f"bench/results/{n}" for n in names if n.startswith(prefix)]
    return [f"bench/results/{n}" for n in names if not n.startswith(kinds)]


def bench_cpu() -> str:
    out = []
    for rel in _results(""):
        results = dict(_json(rel))
        results.pop("gpu_machine", None)  # the GPU rows have their own table, from reports/gpu/results.json
        note = f"`{rel}`: {results['machine']}, Python {results['python']}, {results['when']}" + (
            " (quick run)" if results.get("quick") else ""
        )
        out.append(note + "\n\n" + _run_all().table(results))
    return "\n\n".join(out)


def bench_instructions() -> str:
    out = []
    for rel in _results("instructions-"):
        lines = [
            f"`{rel}`",
            "",
            "| loop | probe / no probe | bare wrapper / no probe | instructions a hooked call | hooked calls a loop |",
            "|---|---|---|---|---|",
        ]
        for key, r in _json(rel).items():
            name = key.replace("_page_size_", ", page size ").replace("_", " ")
            lines.append(
                f"| {name} | {r['ratio']}x | {r['floor_ratio_bare_wrapper']}x | {r['instructions_per_hooked_call']:,} | {r['hooked_calls_per_loop']:,} |"
            )
        out.append("\n".join(lines))
    return "\n\n".join(out)


def bench_request_pools() -> str:
    out = []
    for rel in _results("request-pools-"):
        r = _json(rel)
        lines = [
            f"`{rel}` ({r['requests']:,} requests a loop)",
            "",
            "| request pool | instructions a request, no probe / probe | probe / no probe | hooked calls a request | instructions a hooked call |",
            "|---|---|---|---|---|",
        ]
        for pool in ("classic", "hybrid"):
            p = r[pool]
            per = p["instructions_per_request"]
            lines.append(
                f"| {pool} | {per['off']:,} / {per['compiled']:,} | {p['ratio']}x | {p['hooked_calls_per_request']} | {p['instructions_per_hooked_call']:,} |"
            )
        lines += ["", f"A hooked call of the hybrid pool against one of the classic pool: {r['hybrid_over_classic_per_hooked_call']}x."]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def bench_vllm() -> str:
    out = []
    for rel in _results("vllm-"):
        r = _json(rel)
        calls = r["block_pool_calls"]
        out.append(
            "\n".join(
                [
                    f"`{rel}` ({r['time']}): {r['engine']}, {r['cpus']} CPUs",
                    "",
                    "| figure | without the probe | with the probe | ratio |",
                    "|---|---|---|---|",
                    f"| server throughput, {r['rounds']} rounds of {r['requests_per_round']} requests, concurrency {r['concurrency']} "
                    f"| {r['without_probe_requests_per_s']} requests/s | {r['with_probe_requests_per_s']} requests/s | {r['ratio_with_over_without']}x |",
                    f"| engine core CPU per request | {r['without_probe_engine_core_cpu_ms_per_request']} ms | "
                    f"{r['with_probe_engine_core_cpu_ms_per_request']} ms | {r['engine_core_cpu_ratio_with_over_without']}x |",
                    f"| in process: {calls['step']} | {calls['without_probe_us_per_step']} us | {calls['with_probe_us_per_step']} us "
                    f"| {calls['ratio_with_over_without']}x ({calls['probe_us_per_hooked_call']} us a hooked call) |",
                ]
            )
        )
    return "\n\n".join(out)


def bench_gpu() -> str:
    r = _json(GPU_RESULTS)
    lines = [f"`{GPU_RESULTS}`: {r['machine']}", "", "| figure | measured | target |", "|---|---|---|"]
    for row in r["table"]:
        name, value, target = (list(row) + ["", ""])[:3]
        lines.append(f"| {name.strip() if not name.startswith('  ') else '&nbsp;&nbsp;' + name.strip()} | {value} | {target or '-'} |")
    return "\n".join(lines)


def finding_lines(report: str, kind: str) -> str:
    """The lines of the first `kind` finding in a committed text report: its headline and the
    indented evidence under it."""
    lines = _read(report).splitlines()
    for index, line in enumerate(lines):
        head = HEADLINE.match(line)
        if head and head.group(2) == kind:
            taken = []
            for nxt in lines[index + 1 :]:
                if not nxt.startswith("  ") or nxt.startswith("  note:"):
                    break
                taken.append(nxt)
            return "\n".join([line, *taken])
    raise SystemExit(f"docs/generate.py: {report} has no {kind} finding")


def finding(key: str) -> str:
    _, report, kind = key.split()
    return f"From `{report}`:\n\n```text\n{finding_lines(report, kind)}\n```"


GENERATORS: dict[str, Callable[[], str]] = {
    "probes-table": probes_table,
    "output-formats": output_formats,
    "bench-cpu": bench_cpu,
    "bench-instructions": bench_instructions,
    "bench-request-pools": bench_request_pools,
    "bench-vllm": bench_vllm,
    "bench-gpu": bench_gpu,
}


def report(key: str) -> str:
    """A committed text report whole, but its first line (the trace's path, pids and this
    checkout's interpreter path, which say nothing to a reader)."""
    _, rel = key.split()
    return "```text\n" + "\n".join(_read(rel).splitlines()[1:]) + "\n```"


def block_text(key: str) -> str:
    if key.startswith("finding "):
        return finding(key)
    if key.startswith("report "):
        return report(key)
    if key not in GENERATORS:
        raise SystemExit(f"docs/generate.py: no generator for the block {key!r}")
    return GENERATORS[key]()


def with_blocks(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + block_text(m.group("key")) + "\n" + m.group(4), text)


def _tree_path(target: str) -> str:
    return posixpath.normpath(posixpath.join(posixpath.dirname(GPU_SUMMARY), target))


def gpu_page() -> str:
    """docs/gpu.md: reports/gpu/SUMMARY.md, whose links to the tree's files become their paths
    (the docs site holds pages, not the tree)."""

    def link(m: re.Match[str]) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            return m.group(0)
        path = f"`{_tree_path(target)}`"
        return path if text.strip("`") in (target, posixpath.basename(target), _tree_path(target)) else f"{text} ({path})"

    body = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", link, _read(GPU_SUMMARY))
    head = f"<!-- generated from {GPU_SUMMARY} by docs/generate.py: edit that file, then run the script -->\n"
    return head + body


def expected() -> dict[str, str]:
    """Every generated file's path (relative to the root) and the text it should have."""
    out = {rel: with_blocks(_read(rel)) for rel in PAGES_WITH_BLOCKS}
    out["docs/gpu.md"] = gpu_page()
    return out


def stale() -> list[str]:
    """The generated files whose committed text differs from what this script makes."""
    out = []
    for rel, text in expected().items():
        path = os.path.join(ROOT, rel)
        current = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if current != text:
            out.append(rel)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming the stale files")
    args = parser.parse_args()
    if args.check:
        names = stale()
        for rel in names:
            print(f"docs/generate.py: {rel} is stale: run .venv/bin/python docs/generate.py", file=sys.stderr)
        return 1 if names else 0
    for rel, text in expected().items():
        with open(os.path.join(ROOT, rel), "w", encoding="utf-8") as fh:
            fh.write(text)
    print("docs regenerated: " + ", ".join(expected()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
