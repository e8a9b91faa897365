"""Numbers the probe reads from its environment. It runs inside the server, so a bad value keeps
the default and never raises."""

from __future__ import annotations

import math
import os


def env_positive(name: str, default: float) -> float:
    """The environment variable `name` as a positive finite number, else `default`."""
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 and math.isfinite(value) else default
