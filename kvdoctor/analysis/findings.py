"""A finding: what a detector concluded, with the evidence a reader needs to act on it."""

from __future__ import annotations

import dataclasses
from typing import Any

ERROR = "error"
WARNING = "warning"
INFO = "info"


@dataclasses.dataclass
class Finding:
    kind: str
    severity: str
    message: str
    count: int = 0
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    pid: int = 0
    first_ts_us: float | None = None  # when its first event came (None: made at a census, or unknown)
    caused_by: str = ""  # the earlier finding it follows from ("double_free x64 at _finish"), if any

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "message": self.message,
            "count": self.count,
            "evidence": self.evidence,
            "pid": self.pid,
            **({"caused_by": self.caused_by} if self.caused_by else {}),
        }
