"""How the HTML report writes quantities and text: one decimal for bytes and rates, durations
with room to read, and every string escaped."""

from __future__ import annotations

import html
from typing import Any

from kvdoctor.outputs import printable
from kvdoctor.units import format_bytes, format_duration, format_rate

REPORT_DIGITS = 1  # "1.5 GiB": one decimal everywhere on the page


def human_bytes(value: float) -> str:
    return format_bytes(value, REPORT_DIGITS)


def human_rate(bytes_per_s: float) -> str:
    return format_rate(bytes_per_s, digits=REPORT_DIGITS)


def human_duration(seconds: float) -> str:
    return format_duration(seconds, "readable")


def escape(text: Any) -> str:
    """HTML text; control bytes and bidirectional controls a trace carried are written out."""
    return html.escape(printable(str(text)), quote=True)
