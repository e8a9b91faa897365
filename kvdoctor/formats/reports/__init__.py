"""Reporters render a finished Analysis (or a gate's verdict); each knows nothing of how it was made.

`render(analysis, format)` is the one way in: the format's row in kvdoctor.formats.table names the
module that renders it, and `table.check_format` is the one check of a `--format` value, so a
command refuses a format it cannot write before it does any work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.formats import table


def render(analysis: Analysis, output_format: str) -> str:
    renderer = cast(Callable[[Analysis], str], table.row("replay", output_format).load())
    return renderer(analysis)
