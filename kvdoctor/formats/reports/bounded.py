"""How much of an analysis a report shows: every table a trace can make as long as it likes (its
processes, the findings of one kind, one per allocator) is cut to its first rows, and the rest is
said as a count, so a crafted trace makes a report of bounded size."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from kvdoctor.analysis.findings import Finding

PROCESSES_SHOWN = 16  # in a report's one-line list of processes
PROCESS_ROWS_SHOWN = 64  # in the HTML report's process table
FINDINGS_SHOWN_PER_KIND = 20  # the largest of each kind; the rest is one line


@dataclasses.dataclass
class FindingsLeft:
    """The findings of one kind a report did not show one by one."""

    kind: str
    findings: int = 0
    count: int = 0  # their counts (slots, events) together

    def sentence(self) -> str:
        return f"... and {self.findings} more {self.kind} finding(s), {self.count} in all, not shown one by one (the JSON report has every one)"


def shown_findings(findings: Iterable[Finding], per_kind: int = FINDINGS_SHOWN_PER_KIND) -> tuple[list[Finding], list[FindingsLeft]]:
    """The findings to show (in their order, at most `per_kind` of each kind, the largest first as
    the analysis sorts them) and what is left of each kind."""
    shown: list[Finding] = []
    seen: dict[str, int] = {}
    left: dict[str, FindingsLeft] = {}
    for finding in findings:
        n = seen.get(finding.kind, 0)
        seen[finding.kind] = n + 1
        if n < per_kind:
            shown.append(finding)
            continue
        rest = left.setdefault(finding.kind, FindingsLeft(finding.kind))
        rest.findings += 1
        rest.count += max(int(finding.count or 0), 0)
    return shown, list(left.values())


def first_processes(processes: dict[int, dict[str, Any]], most: int) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """The first `most` processes by pid, and how many more there are."""
    ordered = sorted(processes.items())
    return ordered[:most], max(0, len(ordered) - most)
