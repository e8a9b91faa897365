"""What a CI gate holds a run to: the budgets, their defaults, and the finding kinds a user names.

Apart from the judging (kvdoctor.analysis.gate) so the CLI reads the defaults without loading the
detectors."""

from __future__ import annotations

import dataclasses
import difflib

from kvdoctor.errors import KvdoctorError
from kvdoctor.trace import schema
from kvdoctor.units import HOUR_S, MIB

DEFAULT_MAX_GROWTH = "500MiB/h"
GROWTH_OFF = ("off", "none")  # `--max-growth off`: the user asks for no growth verdict (a job too short for one)
DEFAULT_FAIL_ON = (schema.DOUBLE_FREE, schema.DOUBLE_ALLOC, schema.STALE_LAST_LOC, schema.INDEX_OUT_OF_RANGE)


ANY_ENGINE = "any"
ENGINE_CHOICES = (ANY_ENGINE, *schema.SERVING_ENGINES)  # what `gate --engine` takes
BUDGETED_KINDS = (schema.ORPHAN_SLOTS, schema.MEMORY_GROWTH)  # judged by their own budgets


@dataclasses.dataclass
class Budgets:
    max_growth_bytes_per_s: float = 500 * MIB / HOUR_S
    judge_growth: bool = True  # False: `--max-growth off`, the growth check is said to be off, never passed
    max_orphan_slots: int = 0
    fail_on: set[str] = dataclasses.field(default_factory=lambda: set(DEFAULT_FAIL_ON))
    allow: set[str] = dataclasses.field(default_factory=set)  # error kinds the user waived by name
    engine: str = ANY_ENGINE  # the engine whose probe must report


def finding_kind(name: str) -> str:
    """A finding kind from what a user typed: `double-free` is `double_free`; a name that is no
    kind is refused with the nearest one suggested."""
    kind = name.strip().replace("-", "_")
    if kind in schema.FINDING_KINDS:
        return kind
    near = difflib.get_close_matches(kind, schema.FINDING_KINDS, n=1)
    hint = f"did you mean {near[0]}?" if near else "choose from " + ", ".join(schema.FINDING_KINDS)
    raise KvdoctorError(f"{name.strip()!r} is not a finding kind", hint)


def finding_kinds(text: str, option: str) -> set[str]:
    names = [n for n in (text or "").split(",")]
    if not any(n.strip() for n in names):
        raise KvdoctorError(f"{option} names no finding kind", f"give one or more, e.g. {option} double_free,stale_last_loc")
    return {finding_kind(n) for n in names if n.strip()}
