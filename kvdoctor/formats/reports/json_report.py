"""JSON: `{"schema": "kvdoctor.report/1", "findings": [{"kind", "severity", "message", "count",
"evidence", "pid"}], "processes", "notes", ...}` (the report's own schema, not the trace's).

Strict JSON (kvdoctor.outputs.strict): a number that is not finite is written as null."""

from __future__ import annotations

import json

from kvdoctor.analysis.analyzer import REPORT_SCHEMA_ID, Analysis
from kvdoctor.outputs import strict

__all__ = ["REPORT_SCHEMA_ID", "render_json"]


def render_json(analysis: Analysis) -> str:
    return json.dumps(strict(analysis.to_dict()), indent=2, default=str, allow_nan=False)
