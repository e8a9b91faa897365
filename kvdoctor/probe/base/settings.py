"""What the probe reads from its KVDOCTOR_* environment variables, read here and only here. The probe
runs inside the server, so nothing here raises: a value that is not understood, not finite or out
of its range is said in one line on stderr (once per variable and process) and the default is used,
never a dead probe or a thread that stops. A switch is on for 1/true/yes/on and off for
0/false/no/off (so KVDOCTOR_DISABLE=0 does not disable); unset or empty keeps its default."""

from __future__ import annotations

import math
import os
import sys

OFF = ("0", "false", "no", "off")
ON = ("1", "true", "yes", "on")
DAY_S = 86400.0
_SAID: set[str] = set()
# Variables that were renamed: the old name is still read where the new one is not set.
ALIASES = {
    "KVDOCTOR_NATIVE": "KVDOCTOR_HOTPATH",
    "KVDOCTOR_NATIVE_DLPACK": "KVDOCTOR_HOTPATH_DLPACK",
    "KVDOCTOR_NATIVE_DIRECT": "KVDOCTOR_HOTPATH_DIRECT",
}


def _say(name: str, raw: str, wanted: str, default: object) -> None:
    if name in _SAID:
        return
    _SAID.add(name)
    try:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        shown = shown.encode("ascii", "backslashreplace").decode("ascii")
        sys.stderr.write(f"kvdoctor: {name}={shown!r} is not {wanted}: using {default}\n")
        sys.stderr.flush()
    except Exception:
        pass


def env_name(name: str) -> str:
    """Where the variable is read from: itself, or its old name (ALIASES) where only that is set."""
    old = ALIASES.get(name)
    try:
        if old is not None and not os.environ.get(name, "").strip() and os.environ.get(old, "").strip():
            return old
    except Exception:
        pass
    return name


def env_text(name: str) -> str:
    """The variable's value (or its old name's), stripped ('' when unset)."""
    try:
        return os.environ.get(env_name(name), "").strip()
    except Exception:
        return ""


def env_number(name: str, default: float, *, low: float = 0.0, high: float = DAY_S, low_open: bool = False) -> float:
    """The variable as a finite number in [low, high] ((low, high] with `low_open`), else `default`."""
    raw = env_text(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and (value > low if low_open else value >= low) and value <= high:
        return value
    bound = "(" if low_open else "["
    _say(name, raw, f"a number in {bound}{low:g}, {high:g}]", f"{default:g}")
    return default


def env_positive(name: str, default: float, high: float = DAY_S) -> float:
    """The variable as a positive finite number up to `high` (a day of seconds), else `default`."""
    return env_number(name, default, low=0.0, high=high, low_open=True)


def env_count(name: str, default: int, *, low: int = 1, high: int = 1 << 20) -> int:
    """The variable as a whole number in [low, high], else `default`."""
    raw = env_text(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if low <= value <= high:
        return value
    _say(name, raw, f"a whole number in [{low}, {high}]", default)
    return default


def env_switch(name: str, default: bool) -> bool:
    """The variable as on (1/true/yes/on) or off (0/false/no/off); unset, empty or not understood: `default`."""
    raw = env_text(name)
    if not raw:
        return default
    if raw.lower() in ON:
        return True
    if raw.lower() in OFF:
        return False
    _say(name, raw, "one of 1/true/yes/on or 0/false/no/off", "on" if default else "off")
    return default
