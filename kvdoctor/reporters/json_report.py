"""JSON: `{"findings": [{"kind", "severity", "message", "count", "evidence"}], ...}`."""

from __future__ import annotations

import json

from kvdoctor.analysis.analyzer import Analysis


def render_json(analysis: Analysis) -> str:
    return json.dumps(analysis.to_dict(), indent=2, default=str)
