"""Findings as JSON lines (`--format jsonl`): one object per finding, for log shippers, labelled
as `run --metrics` labels its series (engine, version, pid, title, rank, pool), so a log line
and an alert about the same pool join on the same labels. Each line is strict JSON (ASCII, with
`\\u` escapes), as `--format json` is."""

from __future__ import annotations

import json
import re

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.outputs import strict
from kvdoctor.trace.writer import redact

JSONL_SCHEMA_ID = "kvdoctor.finding/1"
TITLE_LIMIT = 120
_RANK_PART = re.compile(r"(dp|tp|pp|ep)\d+")
_TITLE_RANK = re.compile(r"(?<![A-Za-z])(DP|TP|PP|EP)(\d+)(?![A-Za-z])")


def _rank_of_title(title: str) -> str:
    head = title.split(" ", 1)[0]
    if "::" not in head:
        return ""
    return "/".join(f"{kind.lower()}{number}" for kind, number in _TITLE_RANK.findall(head.split("::", 1)[1]))


def _split_pool(allocator: str) -> tuple[str, str]:
    """A ledger's name `tp1/TokenToKVPoolAllocator#0` as (rank, pool), as the metrics name them."""
    parts = allocator.split("/")
    rank = []
    while len(parts) > 1 and _RANK_PART.fullmatch(parts[0]):
        rank.append(parts.pop(0))
    return "/".join(rank), "/".join(parts)


def render_jsonl(analysis: Analysis) -> str:
    lines = []
    for finding in analysis.findings:
        info = analysis.processes.get(finding.pid, {})
        title = redact(str(info.get("process_title") or ""))[:TITLE_LIMIT]
        evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
        rank, pool = _split_pool(str(evidence.get("allocator") or ""))
        labels = {
            "engine": str(info.get("engine") or ""),
            "version": str(info.get("engine_version") or ""),
            "title": title,
            "rank": rank or _rank_of_title(title),
            "pool": pool,
        }
        record = {"schema": JSONL_SCHEMA_ID, **labels, **finding.to_dict()}
        # strict JSON, as --format json: no NaN, nothing nested past MAX_DEPTH, and every control
        # character (DEL and C1 too) as a \u escape, which `printable` leaves alone
        lines.append(json.dumps(strict(record), sort_keys=False, default=str, allow_nan=False))
    return "\n".join(lines)
