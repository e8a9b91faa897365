"""Held, broken or not judged: what a growth budget says of one memory series, and why.

The rule, as a user applies it: kvdoctor skips a process's start-up (until its memory first holds
still for 10 s, at most its first 60 s; an engine's lasts until it first serves a request) and then fails a growth budget only on a climb sustained
over at least 30 s of what follows, rising 64 MiB in all, whose rate at 99% confidence is above
the budget (the steeper the climb, the less data that takes). It passes the budget only when the data after the start-up
bounds the rate under the budget at 99%; anything between is "not judged", with the reason, and
never a pass.

Plain numbers in, plain numbers out (no clock, no I/O), like kvdoctor.analysis.growth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvdoctor.analysis.growth import GrowthParams, _decelerating, plausible_points, theil_sen
from kvdoctor.analysis.serving_start import startup_end_s
from kvdoctor.units import format_bytes, format_duration, format_rate

HELD = "held"
BROKEN = "broken"
NOT_JUDGED = "not judged"
MIN_HELD_SAMPLES = 8  # fewer points after the start-up bound no rate


@dataclasses.dataclass(frozen=True)
class GrowthEvidence:
    """What one series after its start-up allows: its span, and the rates the data leaves open."""

    origin_s: float  # the process's start (or the first sample)
    startup_end_s: float
    start_s: float  # the span judged: from the end of the start-up to the last sample
    end_s: float
    samples: int
    lower_bytes_per_s: float | None  # None: too few points to bound the rate
    upper_bytes_per_s: float | None
    min_span_s: float
    confidence: float
    rise_bytes: float | None = None  # the fitted rise over the span (None: no fit)
    min_rise_bytes: float = 0.0

    @property
    def span_s(self) -> float:
        return max(0.0, self.end_s - self.start_s)

    @property
    def startup_s(self) -> float:
        return max(0.0, self.startup_end_s - self.origin_s)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "span_s": self.span_s, "startup_s": self.startup_s}


def growth_evidence(
    params: GrowthParams, times_s: Sequence[float], values: Sequence[float], *, origin_s: float | None = None, ready_s: float | None = None
) -> GrowthEvidence | None:
    """The evidence of one series (None when it has no point). A series that bends flat (a cache
    that filled) is bounded by its later half, the rest by its whole span after the start-up."""
    times_s, values = plausible_points(times_s, values)
    if not times_s:
        return None
    origin = times_s[0] if origin_s is None else origin_s
    end_of_startup = startup_end_s(params, times_s, values, origin_s=origin, ready_s=ready_s)
    first = next((i for i, t in enumerate(times_s) if t >= end_of_startup), len(times_s))
    t, v = list(times_s[first:]), [float(x) for x in values[first:]]
    lower = upper = rise = None
    if len(t) >= MIN_HELD_SAMPLES and t[-1] - t[0] >= params.settle_s:
        overall = theil_sen(t, v, confidence=params.confidence, max_points=params.max_points)
        if overall is not None:
            lower, upper = overall.lower, overall.upper
            rise = overall.slope * (t[-1] - t[0])
            if _decelerating(t, v, params):
                half = next(i for i, ti in enumerate(t) if ti >= t[0] + (t[-1] - t[0]) / 2)
                later = theil_sen(t[half:], v[half:], confidence=params.confidence, max_points=params.max_points)
                if later is not None and len(t) - half >= MIN_HELD_SAMPLES:
                    upper = min(upper, later.upper)
    return GrowthEvidence(
        origin_s=origin,
        startup_end_s=end_of_startup,
        start_s=t[0] if t else times_s[-1],
        end_s=times_s[-1],
        samples=len(t),
        lower_bytes_per_s=lower,
        upper_bytes_per_s=upper,
        min_span_s=params.min_span_s,
        confidence=params.confidence,
        rise_bytes=rise,
        min_rise_bytes=params.min_rise_bytes,
    )


def growth_verdict(evidence: dict[str, Any], found_bytes_per_s: float | None, budget_bytes_per_s: float) -> tuple[str, str]:
    """(HELD, BROKEN or NOT_JUDGED, the sentence that says why) of one series against a budget.
    `evidence` is a GrowthEvidence's to_dict; `found_bytes_per_s` the rate of its growth finding."""
    budget = format_rate(budget_bytes_per_s, digits=1)
    span = format_duration(float(evidence.get("span_s") or 0.0))
    after = f"{span} of data after its start-up ({format_duration(float(evidence.get('startup_s') or 0.0))})"
    if found_bytes_per_s is not None and found_bytes_per_s > budget_bytes_per_s:
        return BROKEN, f"grows {format_rate(found_bytes_per_s, digits=1)}, over the budget of {budget}"
    if found_bytes_per_s is not None:
        return HELD, f"grows {format_rate(found_bytes_per_s, digits=1)}, within the budget of {budget}"
    upper, lower = evidence.get("upper_bytes_per_s"), evidence.get("lower_bytes_per_s")
    level = f"{float(evidence.get('confidence') or 0.99) * 100:.0f}%"
    if upper is not None and upper < budget_bytes_per_s:
        return HELD, f"at most {format_rate(max(upper, 0.0), digits=1)} at {level} over {after}"
    if upper is None:
        needed = format_duration(float(evidence.get("min_span_s") or 0.0))
        return NOT_JUDGED, f"{after}: too little to bound its rate ({needed} needed to call growth)"
    between = f"its rate lies between {format_rate(lower, digits=1)} and {format_rate(upper, digits=1)} at {level}"
    if float(evidence.get("span_s") or 0.0) < float(evidence.get("min_span_s") or 0.0):
        needed = format_duration(float(evidence.get("min_span_s") or 0.0))
        return NOT_JUDGED, f"{after}, {needed} needed to call growth; {between}"
    rise, min_rise = evidence.get("rise_bytes"), float(evidence.get("min_rise_bytes") or 0.0)
    if rise is not None and float(rise) < min_rise:
        risen = format_bytes(max(float(rise), 0.0))
        return NOT_JUDGED, f"{between}, a rise of {risen} over {after}: a climb is called once it rises {format_bytes(min_rise)}"
    return NOT_JUDGED, f"{between} over {after}: neither a sustained climb nor bounded under {budget}"
