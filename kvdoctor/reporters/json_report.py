"""JSON: `{"schema": "kvdoctor.report/1", "findings": [{"kind", "severity", "message", "count",
"evidence", "pid"}], "processes", "notes", ...}` (the report's own schema, not the trace's).

Strict JSON: a number that is not finite (a NaN or an infinity a damaged trace carried into the
evidence) is written as null, since strict parsers (JavaScript's, jq's) reject `NaN`/`Infinity`."""

from __future__ import annotations

import json
import math
from typing import Any

from kvdoctor.analysis.analyzer import REPORT_SCHEMA_ID, Analysis

__all__ = ["REPORT_SCHEMA_ID", "render_json", "strict"]


def render_json(analysis: Analysis) -> str:
    return json.dumps(strict(analysis.to_dict()), indent=2, default=str, allow_nan=False)


def strict(value: Any) -> Any:
    """`value` with every non-finite float as None, through dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value
