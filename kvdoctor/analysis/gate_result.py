"""A gate's outcome: one check per budget, and the verdict they add up to (kvdoctor.analysis.gate
judges them). A check passes, fails, could not be judged (nothing to judge it on), was turned off by
the user, or does not apply to the run (no slot ledger in it): only a judged check can pass."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvdoctor.errors import EXIT_FINDINGS, EXIT_OK, EXIT_UNUSABLE
from kvdoctor.outputs import one_line


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    detail: str
    judged: bool = True  # False: nothing to judge it on (it neither passes nor fails)
    warning: bool = False  # passed, with something the user should see (it never fails the gate)
    off: bool = False  # turned off by the user: neither passed nor judged, and it never fails the gate
    applicable: bool = True  # False: the run has nothing it could judge (no slot ledger): neither passes nor fails

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "passed": self.passed,
            "judged": self.judged,
            "warning": self.warning,
            "off": self.off,
            "applicable": self.applicable,
            "detail": self.detail,
        }


@dataclasses.dataclass
class GateResult:
    checks: list[Check] = dataclasses.field(default_factory=list)
    judged: bool = True
    reason: str = ""  # why it could not judge, when judged is False
    source: str = ""

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.judged and not c.passed and not c.off and c.applicable]

    @property
    def unjudged(self) -> list[Check]:
        return [c for c in self.checks if not c.judged and not c.off and c.applicable]

    @property
    def turned_off(self) -> list[Check]:
        return [c for c in self.checks if c.off]

    @property
    def not_applicable(self) -> list[Check]:
        return [c for c in self.checks if not c.applicable and not c.off]

    @property
    def warned(self) -> list[Check]:
        return [c for c in self.checks if c.judged and c.passed and c.warning and c.applicable]

    @property
    def exit_code(self) -> int:
        if self.failed:
            return EXIT_FINDINGS
        if not self.judged or self.unjudged:
            return EXIT_UNUSABLE
        return EXIT_OK

    def verdict(self) -> str:
        if self.failed:
            return f"kvdoctor gate: FAIL ({len(self.failed)} of {len(self.checks)} checks failed)"
        if not self.judged:
            return f"kvdoctor gate: COULD NOT JUDGE ({self.reason})"
        if self.unjudged:
            return f"kvdoctor gate: COULD NOT JUDGE ({'; '.join(c.detail for c in self.unjudged)})"
        warned = f", {len(self.warned)} warning{'s' if len(self.warned) > 1 else ''}" if self.warned else ""
        off = f", {len(self.turned_off)} turned off: {', '.join(c.name for c in self.turned_off)}" if self.turned_off else ""
        na = self.not_applicable
        off += f", {len(na)} not applicable: {', '.join(c.name for c in na)}" if na else ""
        return f"kvdoctor gate: PASS ({len(self.checks) - len(self.turned_off) - len(na)} checks{warned}{off})"

    def summary_lines(self) -> list[str]:
        """One line per check: a detail quotes the trace (request ids, titles), which never starts
        a line of its own (a forged `PASS` line, or a `::error` command in a CI log)."""
        lines = [f"kvdoctor gate: {one_line(self.source)}"] if self.source else []
        for check in self.checks:
            mark = _mark(check)
            lines.append(f"  {mark}  {check.name}: {one_line(check.detail)}")
        lines.append(one_line(self.verdict()))
        return lines


def _mark(check: Check) -> str:
    if check.off:
        return "OFF "
    if check.passed and check.applicable:
        return "WARN" if check.warning else "PASS"
    return "FAIL" if check.judged and check.applicable else "N/A "
