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
    caused_by: str = ""  # the earlier finding it follows from ("double_free x64 slots at _finish"), if any
    unit: str = ""  # what `count` counts ("slots", "last_loc values"); one unit for the count and its sentence
    page_size: int = 1  # the allocator's page size where `unit` is slots: above one, the pages are said too

    def counted(self) -> str:
        """The count with its unit: "64 slots", "4 slots (1 page of 4)"; "" for no count."""
        if not self.count:
            return ""
        text = f"{self.count} {self.unit}".rstrip()
        if self.unit == "slots" and self.page_size > 1:
            pages = -(-self.count // self.page_size)
            text += f" ({pages} page{'' if pages == 1 else 's'} of {self.page_size})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "message": self.message,
            "count": self.count,
            "evidence": self.evidence,
            "pid": self.pid,
            **({"unit": self.unit} if self.unit else {}),
            **({"page_size": self.page_size} if self.unit == "slots" and self.page_size > 1 else {}),
            **({"caused_by": self.caused_by} if self.caused_by else {}),
        }
