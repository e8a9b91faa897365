"""When a process's start-up ends, for the memory growth tests; an engine's, at its first request.

A server's memory climbs while it loads its weights, compiles kernels and captures graphs, for as
long as that takes: minutes for a large model, far longer under compute-sanitizer. That climb is no
leak, and a fixed warm-up (60 s) called it one (an H200 server under memcheck, still compiling at
90 s, was named growing 4.9 GiB/h). So a process whose probe found an engine there (its
`serving` status "starting") is in its start-up until a process of the run first serves a request
(the `serving` status "on"), at most `ENGINE_START_MAX_S` after it started: a server no request
reaches is judged from then. Other processes, and traces without the status, keep the fixed warm-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvdoctor.trace import schema
from kvdoctor.units import finite_number

ENGINE_START_MAX_S = 900.0  # an engine that serves nothing for 15 min is judged as started


class StartupParams(Protocol):
    """The knobs of the start-up rule (kvdoctor.analysis.growth.GrowthParams has them)."""

    @property
    def warmup_s(self) -> float: ...
    @property
    def settle_s(self) -> float: ...
    @property
    def settle_bytes(self) -> float: ...


class ServingStart:
    """The first served request of the run, and which processes wait for it."""

    consumes = frozenset({schema.PROBE_STATUS})

    def __init__(self) -> None:
        self._marked: set[int] = set()
        self.first_served_s: float | None = None

    def feed(self, event: schema.Event) -> None:
        if event.name != schema.PROBE_STATUS or event.args.get("component") != schema.SERVING:
            return
        self._marked.add(event.pid)
        if event.args.get("state") == "on":
            t_s = finite_number(event.ts)
            if t_s is not None:
                t_s /= 1e6
                self.first_served_s = t_s if self.first_served_s is None else min(self.first_served_s, t_s)

    def forget(self, pid: int) -> None:
        self._marked.discard(pid)

    def ready_s(self, pid: int, origin_s: float | None) -> float | None:
        """The earliest time `pid`'s start-up may end (None: the fixed warm-up alone decides)."""
        if pid not in self._marked or origin_s is None:
            return None
        cap = origin_s + ENGINE_START_MAX_S
        return cap if self.first_served_s is None else min(self.first_served_s, cap)


def startup_end_s(
    params: StartupParams, times_s: Sequence[float], values: Sequence[float], *, origin_s: float | None = None, ready_s: float | None = None
) -> float:
    """When the process's start-up ends: the first time its memory holds still (within a band of
    `settle_bytes` for `settle_s`, at least 5 samples), at the latest `warmup_s` after `origin_s` (the
    process's start; the first sample when not given). A process that allocates once and holds
    flat is judged from its flat part; one that climbs from its start is judged after `warmup_s`.
    `ready_s`, where known, is the earliest it may end: an engine's first served request
    (kvdoctor.analysis.serving_start), however long its loading took."""
    if not times_s:
        return 0.0 if ready_s is None else ready_s
    end = _startup_end_s(params, times_s, values, times_s[0] if origin_s is None else origin_s)
    return end if ready_s is None else max(end, ready_s)


def _startup_end_s(params: StartupParams, times_s: Sequence[float], values: Sequence[float], origin: float) -> float:
    cap = origin + max(params.warmup_s, 0.0)
    if params.settle_s <= 0 or cap <= times_s[0]:
        return cap
    n = len(times_s)
    j = 0
    for i in range(n):
        if times_s[i] >= cap:
            break
        while j < n and times_s[j] - times_s[i] < params.settle_s:
            j += 1
        if j >= n:
            break
        stretch = values[i : j + 1]
        if len(stretch) >= 5 and max(stretch) - min(stretch) < params.settle_bytes:
            return times_s[i]
    return cap
