"""Is this memory series growing without bound? Robust slope math, free of clocks and I/O.

Memory of a serving process is noisy (allocator churn, GC, request bursts) and often rises for a
while and then stops (caches, pools, CUDA graphs warming up). A least-squares line through such
data calls many healthy processes leaking, so the decision here is built from three parts:

* Theil–Sen slope (median of pairwise slopes), which a few spikes cannot move, with the
  rank-based (Sen) confidence interval, widened when the residuals are autocorrelated
  (memory series are: a random walk has far less information than its sample count suggests);
* a minimum rate: the lower confidence bound must exceed it (default 50 MiB/h), so that tiny
  drifts that would take weeks to matter are not reported;
* a minimum climb: the fitted rise over the span judged must reach 64 MiB, since a serving
  process's heap grows by tens of MiB as it warms to its first load (the main process of a tiny
  SGLang server on a CPU rose 10-13 MiB in its first 40 s of requests, and the 99% bound of that
  rise read above 50 MiB/h on a loaded machine); a leak steep enough to matter in a short run
  passes it in seconds (10 GiB/h rises 64 MiB in 23 s), a slow one is judged once it has risen;
* CPython's refleak rule in another shape: split the analysed span into consecutive windows and
  require every one of them to grow, with the latest still growing at a real fraction of the
  overall rate, and the later half of the span growing on its own with confidence. A cache that
  fills up and stops fails this however large its early growth was, and so does one early rise
  followed by noise.

Known blind spot: memory that wanders like a random walk is indistinguishable from a slow leak
over a short watch; the autocorrelation correction only makes that rarer.

Everything here takes plain sequences of seconds and bytes, so tests drive it with a fake clock.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

from kvdoctor.analysis.serving_start import startup_end_s
from kvdoctor.units import HOUR_S, MIB

try:  # numpy makes the pairwise slopes cheap; the pure-Python path uses fewer points.
    import numpy

    _np: Any = numpy
except ImportError:  # pragma: no cover - depends on the environment
    _np = None

DEFAULT_MIN_RATE_BYTES_PER_S = 50 * MIB / HOUR_S  # 50 MiB/h: below this, a leak is not urgent
DEFAULT_WARMUP_S = 60.0
DEFAULT_WINDOWS = 4
DEFAULT_MIN_SPAN_S = 30.0  # a sustained climb is called on 30 s of data after the start-up, at the earliest
DEFAULT_MIN_RISE_BYTES = 64 * MIB  # and once it has risen this much over the span judged
DEFAULT_MIN_SAMPLES = 20  # at least 5 samples per window
DEFAULT_SETTLE_S = 10.0  # the start-up is over once memory holds still this long
DEFAULT_SETTLE_BYTES = 8 * MIB  # "holds still": it stays within this band over that stretch
MIN_WINDOWS = 3  # a staircase whose steps are longer than a quarter of the span is tried on fewer
DEFAULT_CONFIDENCE = 0.99  # one-sided level of the lower bound
DEFAULT_RECENT_FRACTION = 0.5  # latest window must still grow at this fraction of the overall rate
DEFAULT_MAX_POINTS = 600  # points kept for the pairwise slopes (about 180k pairs)
_MAX_POINTS_NO_NUMPY = 200
# A value beyond this (4 EiB) is no machine's memory but a damaged or crafted trace: such points
# are left out of a fit, whose squares and sums would otherwise overflow into NaN.
MAX_PLAUSIBLE_VALUE = float(1 << 62)


@dataclasses.dataclass(frozen=True)
class GrowthParams:
    """The knobs of `detect_growth`, in one place so detectors and commands pass them through."""

    warmup_s: float = DEFAULT_WARMUP_S
    windows: int = DEFAULT_WINDOWS
    min_rate_bytes_per_s: float = DEFAULT_MIN_RATE_BYTES_PER_S
    min_span_s: float = DEFAULT_MIN_SPAN_S
    min_rise_bytes: float = DEFAULT_MIN_RISE_BYTES
    min_samples: int = DEFAULT_MIN_SAMPLES
    confidence: float = DEFAULT_CONFIDENCE
    recent_fraction: float = DEFAULT_RECENT_FRACTION
    max_points: int = DEFAULT_MAX_POINTS
    settle_s: float = DEFAULT_SETTLE_S
    settle_bytes: float = DEFAULT_SETTLE_BYTES
    budget_bytes_per_s: float | None = None  # what a verdict is judged against (None: min_rate_bytes_per_s)


@dataclasses.dataclass(frozen=True)
class SlopeEstimate:
    """A Theil–Sen slope with its confidence bounds, all in value units per second."""

    slope: float
    lower: float
    upper: float
    intercept: float
    points: int


@dataclasses.dataclass(frozen=True)
class GrowthResult:
    """Evidence that a series grows: the robust rate, its bounds, and the span it was seen over."""

    bytes_per_s: float
    lower_bytes_per_s: float
    upper_bytes_per_s: float
    window_start_s: float
    window_end_s: float
    samples: int
    windows: int
    window_slopes_bytes_per_s: tuple[float, ...]
    confidence: float
    start_bytes: float
    end_bytes: float

    @property
    def bytes_per_hour(self) -> float:
        return self.bytes_per_s * HOUR_S

    @property
    def lower_bytes_per_hour(self) -> float:
        return self.lower_bytes_per_s * HOUR_S

    @property
    def duration_s(self) -> float:
        return self.window_end_s - self.window_start_s


def decimate(times_s: Sequence[float], values: Sequence[float], max_points: int) -> tuple[list[float], list[float]]:
    """Reduces a series to at most `max_points` by block medians (robust to single spikes).

    The pairwise-slope cost is quadratic in points; medians of consecutive blocks keep the shape
    of the series while dropping the sample-to-sample jitter that adds no information.
    """
    n = len(times_s)
    if n <= max_points:
        return list(times_s), list(values)
    out_t: list[float] = []
    out_v: list[float] = []
    for k in range(max_points):
        lo = k * n // max_points
        hi = (k + 1) * n // max_points
        if hi <= lo:
            continue
        block_t = times_s[lo:hi]
        out_t.append(sum(block_t) / len(block_t))
        out_v.append(statistics.median(values[lo:hi]))
    return out_t, out_v


def plausible_points(times_s: Sequence[float], values: Sequence[float]) -> tuple[Sequence[float], Sequence[float]]:
    """The points whose time and value are finite and whose value is within ±MAX_PLAUSIBLE_VALUE
    (the series itself when all are, the common case, without a copy)."""
    limit = MAX_PLAUSIBLE_VALUE
    if all(math.isfinite(t) for t in times_s) and all(-limit <= v <= limit for v in values):
        return times_s, values
    kept = [(t, v) for t, v in zip(times_s, values, strict=False) if math.isfinite(t) and -limit <= v <= limit]
    return [t for t, _ in kept], [v for _, v in kept]


def _z(confidence: float) -> float:
    confidence = min(max(confidence, 0.5), 0.999999)
    return statistics.NormalDist().inv_cdf(confidence)


def _lag1_autocorrelation(residuals: Sequence[float]) -> float:
    n = len(residuals)
    if n < 3:
        return 0.0
    mean = sum(residuals) / n
    centred = [r - mean for r in residuals]
    denom = sum(c * c for c in centred)
    if denom <= 0.0:
        return 0.0
    num = sum(centred[i] * centred[i + 1] for i in range(n - 1))
    r = num / denom
    return r if math.isfinite(r) else 0.0


def _pairwise_slopes(times_s: Sequence[float], values: Sequence[float]) -> Any:
    """Slopes of every pair with distinct times, unsorted (a numpy array, or a list)."""
    if _np is not None:
        t = _np.asarray(times_s, dtype=float)
        v = _np.asarray(values, dtype=float)
        i, j = _np.triu_indices(len(t), k=1)
        dt = t[j] - t[i]
        keep = dt > 0
        return (v[j][keep] - v[i][keep]) / dt[keep]
    out: list[float] = []
    n = len(times_s)
    for i in range(n):
        ti, vi = times_s[i], values[i]
        for j in range(i + 1, n):
            dt = times_s[j] - ti
            if dt > 0:
                out.append((values[j] - vi) / dt)
    return out


def _order_statistics(slopes: Any, indices: list[int]) -> list[float]:
    """The k-th smallest slopes for each k in `indices` (numpy partitions instead of sorting)."""
    if _np is not None:
        wanted = sorted(set(indices))
        part = _np.partition(slopes, wanted)
        return [float(part[k]) for k in indices]
    ordered = sorted(slopes)
    return [ordered[k] for k in indices]


def theil_sen(
    times_s: Sequence[float], values: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE, max_points: int = DEFAULT_MAX_POINTS
) -> SlopeEstimate | None:
    """Median pairwise slope with Sen's rank-based bounds at one-sided level `confidence`.

    The bounds come from the normal approximation of Kendall's S (var = n(n-1)(2n+5)/18), whose
    variance is multiplied by (1+r)/(1-r) for a positive lag-1 autocorrelation r of the
    residuals: without that, a slowly wandering plateau would look like a confident trend.
    Returns None with fewer than 3 points or no spread in time.
    """
    if len(times_s) != len(values):
        raise ValueError("times_s and values differ in length")
    times_s, values = plausible_points(times_s, values)
    limit = max_points if _np is not None else min(max_points, _MAX_POINTS_NO_NUMPY)
    t, v = decimate(times_s, values, max(3, limit))
    n = len(t)
    if n < 3:
        return None
    slopes = _pairwise_slopes(t, v)
    count = len(slopes)
    if count == 0:
        return None
    mid_lo, mid_hi = (count - 1) // 2, count // 2
    # first pass: the median, to get residuals for the autocorrelation correction
    med_a, med_b = _order_statistics(slopes, [mid_lo, mid_hi])
    slope = (med_a + med_b) / 2.0
    intercept = statistics.median([vi - slope * ti for ti, vi in zip(t, v, strict=False)])
    residuals = [vi - (intercept + slope * ti) for ti, vi in zip(t, v, strict=False)]
    r1 = min(max(_lag1_autocorrelation(residuals), 0.0), 0.95)
    var_s = n * (n - 1) * (2 * n + 5) / 18.0 * (1 + r1) / (1 - r1)
    c = _z(confidence) * math.sqrt(var_s)
    if not (math.isfinite(slope) and math.isfinite(c)):
        return None  # no finite fit: nothing can be said of this series
    lo_rank = int(math.floor((count - c) / 2.0))  # 1-based rank of the lower bound
    hi_rank = int(math.ceil((count + c) / 2.0)) + 1  # 1-based rank of the upper bound
    lo_index = min(max(lo_rank - 1, 0), count - 1)
    hi_index = min(max(hi_rank - 1, 0), count - 1)
    lower, upper = _order_statistics(slopes, [lo_index, hi_index])
    return SlopeEstimate(slope=slope, lower=lower, upper=upper, intercept=intercept, points=n)


def _window_grew(times_s: Sequence[float], values: Sequence[float], max_points: int) -> tuple[bool, float]:
    """Did this window grow, and at what rate? Its Theil–Sen slope is > 0, or, for a staircase
    whose flat steps tie the median near 0, its last quarter sits above its first quarter; the
    rate is the larger of the slope and the steps' own rise (quarter to quarter)."""
    est = theil_sen(times_s, values, max_points=max_points)
    if est is None:
        return False, 0.0
    step_rate = 0.0
    if len(values) >= 4:
        quarter = max(1, len(values) // 4)
        rise = statistics.median(values[-quarter:]) - statistics.median(values[:quarter])
        apart = (sum(times_s[-quarter:]) - sum(times_s[:quarter])) / quarter
        step_rate = rise / apart if apart > 0 else 0.0
    if est.slope > 0:
        return True, max(est.slope, step_rate)
    if est.slope == 0 and step_rate > 0:
        return True, step_rate
    return False, est.slope


def _check_span(times_s: Sequence[float], values: Sequence[float], params: GrowthParams) -> GrowthResult | None:
    """The test on one span, with the windows asked for and then, for a staircase whose steps a
    quarter of the span can miss, on fewer (never under MIN_WINDOWS)."""
    for windows in range(params.windows, min(params.windows, MIN_WINDOWS) - 1, -1):
        result = _check_windows(times_s, values, dataclasses.replace(params, windows=windows))
        if result is not None:
            return result
    return None


def _check_windows(times_s: Sequence[float], values: Sequence[float], params: GrowthParams) -> GrowthResult | None:
    n = len(times_s)
    if n < max(params.min_samples, 3 * params.windows) or times_s[-1] - times_s[0] < params.min_span_s:
        return None
    overall = theil_sen(times_s, values, confidence=params.confidence, max_points=params.max_points)
    if overall is None or overall.lower <= 0 or overall.lower < params.min_rate_bytes_per_s:
        return None
    start, end = times_s[0], times_s[-1]
    if overall.slope * (end - start) < params.min_rise_bytes:
        return None  # a warm-up's worth of heap, however steady: not yet a climb
    window_slopes: list[float] = []
    width = (end - start) / params.windows
    bounds = [0]
    for k in range(1, params.windows):
        # first index at or after the cut (times are sorted)
        bounds.append(bisect.bisect_left(times_s, start + k * width, bounds[-1], n))
    bounds.append(n)
    per_window_points = max(3, params.max_points // params.windows)
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b - a < 3:
            return None
        grew, slope = _window_grew(times_s[a:b], values[a:b], per_window_points)
        if not grew:
            return None
        window_slopes.append(slope)
    if window_slopes[-1] < params.recent_fraction * overall.slope:
        return None  # still rising a little, but decelerating like a cache that is filling up
    # The growth must be sustained, not one early rise plus noise: the later half of the span
    # must show growth on its own at the same confidence.
    half = bounds[params.windows // 2] if params.windows >= 2 else 0
    recent = theil_sen(times_s[half:], values[half:], confidence=params.confidence, max_points=params.max_points)
    if recent is None or recent.lower <= 0:
        return None
    quarter = max(1, n // (4 * params.windows))
    return GrowthResult(
        bytes_per_s=overall.slope,
        lower_bytes_per_s=overall.lower,
        upper_bytes_per_s=overall.upper,
        window_start_s=start,
        window_end_s=end,
        samples=n,
        windows=params.windows,
        window_slopes_bytes_per_s=tuple(window_slopes),
        confidence=params.confidence,
        start_bytes=float(statistics.median(values[:quarter])),
        end_bytes=float(statistics.median(values[-quarter:])),
    )


def detect_growth_with(
    params: GrowthParams,
    times_s: Sequence[float],
    values_bytes: Sequence[float],
    *,
    origin_s: float | None = None,
    ready_s: float | None = None,
) -> GrowthResult | None:
    """Returns evidence of unbounded growth, or None when the series does not show it (yet).

    `times_s` must be increasing. Samples of the start-up are ignored (`startup_end_s`). The
    post-start-up series is analysed whole; if that fails, its most recent half, quarter and so on
    down to `min_span_s` are tried too, so a leak that starts late in a long watch is found once
    its own span is long enough.
    """
    if len(times_s) != len(values_bytes):
        raise ValueError("times_s and values_bytes differ in length")
    times_s, values_bytes = plausible_points(times_s, values_bytes)
    if not times_s or params.windows < 1:
        return None
    first = bisect.bisect_left(times_s, startup_end_s(params, times_s, values_bytes, origin_s=origin_s, ready_s=ready_s))
    t = list(times_s[first:])
    v = [float(x) for x in values_bytes[first:]]
    if len(t) < 3:
        return None
    result = _check_span(t, v, params)
    if result is not None:
        return result
    if _decelerating(t, v, params):
        return None  # the whole span bends flat: a filling cache, whatever its recent part says
    while True:  # ever shorter recent spans, down to the shortest that can be judged
        half = t[0] + (t[-1] - t[0]) / 2
        keep = next((i for i, ti in enumerate(t) if ti >= half), len(t))
        t, v = t[keep:], v[keep:]
        if len(t) < 3 or t[-1] - t[0] < params.min_span_s:
            return None
        result = _check_span(t, v, params)
        if result is not None:
            return result
    return None


def _decelerating(times_s: Sequence[float], values: Sequence[float], params: GrowthParams) -> bool:
    """True when the span rises overall but its latest window grows far slower than the whole."""
    overall = theil_sen(times_s, values, max_points=params.max_points)
    if overall is None or overall.slope <= 0:
        return False
    cut = times_s[-1] - (times_s[-1] - times_s[0]) / max(params.windows, 1)
    first = next((i for i, ti in enumerate(times_s) if ti >= cut), len(times_s))
    last = theil_sen(times_s[first:], values[first:], max_points=max(3, params.max_points // max(params.windows, 1)))
    return last is not None and last.slope < params.recent_fraction * overall.slope


def detect_growth(
    times_s: Sequence[float], values_bytes: Sequence[float], *, origin_s: float | None = None, ready_s: float | None = None, **knobs: Any
) -> GrowthResult | None:
    """`detect_growth_with` with its knobs (the fields of `GrowthParams`) given by name."""
    return detect_growth_with(GrowthParams(**knobs), times_s, values_bytes, origin_s=origin_s, ready_s=ready_s)


def time_to_oom_s(current_bytes: float, bytes_per_s: float, limit_bytes: float | None) -> float | None:
    """Seconds until `current_bytes` reaches `limit_bytes` at `bytes_per_s`; None if never/unknown."""
    if limit_bytes is None or limit_bytes <= 0 or bytes_per_s <= 0:
        return None
    return max(0.0, (limit_bytes - current_bytes) / bytes_per_s)
