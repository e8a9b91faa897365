"""JSON: `{"schema": "kvdoctor.report/1", "findings": [{"kind", "severity", "message", "count",
"evidence", "pid"}], "processes", "notes", ...}` (the report's own schema, not the trace's)."""

from __future__ import annotations

import json

from kvdoctor.analysis.analyzer import REPORT_SCHEMA_ID, Analysis

__all__ = ["REPORT_SCHEMA_ID", "render_json"]


def render_json(analysis: Analysis) -> str:
    return json.dumps(analysis.to_dict(), indent=2, default=str)
