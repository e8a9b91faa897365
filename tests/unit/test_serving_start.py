"""An engine's start-up lasts until it first serves: its loading climb is no leak, however long it takes.

The case is the one a whole SGLang server on an H200 under compute-sanitizer gave (2026-12-02): its
scheduler still compiling kernels at 90 s, its anonymous memory climbing, named growing 4.9 GiB/h by
the fixed 60 s warm-up. Each trace here goes through the whole analysis (`analyze`), as replay runs it.
"""

from __future__ import annotations

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.analysis.growth import GrowthParams
from kvdoctor.analysis.serving_start import ENGINE_START_MAX_S, startup_end_s
from kvdoctor.trace import schema

MIB = 1024 * 1024
START_S = 1_800_000_000.0  # the process's start (epoch seconds, as the sampler writes it)
PID = 4242


def header(marks_serving: bool) -> list[schema.Event]:
    """The process's header, and where the probe found an engine there, its "starting" status."""
    extra = {"process_start_s": START_S, "probe": "kvdoctor"}
    out = [schema.header_event(pid=PID, engine="sglang", engine_version="0.5.23", process_title="sglang::scheduler", extra=extra)]
    if marks_serving:
        args = {"component": schema.SERVING, "state": "starting", "reason": "sglang imported"}
        out.append(schema.Event(ph="i", name=schema.PROBE_STATUS, pid=PID, ts=(START_S + 2) * 1e6, args=args))
    return out


def climb(seconds: float, *, every_s: float = 1.0, mib_per_s: float = 2.0, from_s: float = 0.0) -> list[schema.Event]:
    """The process's memory: flat 1 GiB until `from_s`, then climbing `mib_per_s`, for `seconds`."""
    out = []
    for i in range(int(seconds / every_s)):
        t = i * every_s
        anon = 1024 * MIB + max(0.0, t - from_s) * mib_per_s * MIB
        out.append(
            schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=PID, ts=(START_S + t) * 1e6, args={"anon_bytes": anon, "rss_bytes": anon})
        )
    return out


def served_at(t_s: float, pid: int = PID) -> schema.Event:
    return schema.Event(
        ph="i",
        name=schema.PROBE_STATUS,
        pid=pid,
        ts=(START_S + t_s) * 1e6,
        args={"component": schema.SERVING, "state": "on", "reason": "first request"},
    )


def growth_findings(events: list[schema.Event]) -> list:
    events = sorted(events, key=lambda e: (e.ph != "M", e.ts))
    return [f for f in analyze(events).findings if f.kind == schema.MEMORY_GROWTH]


def test_a_loading_climb_before_the_first_request_is_not_called_growth() -> None:
    """The H200 case: memory climbs from the start for 150 s and the process dies still loading, no
    request served. The fixed warm-up alone names it (the trace without the mark); the engine's own
    start-up does not."""
    loading = climb(150, mib_per_s=2.0)
    assert growth_findings([*header(False), *loading]), "the fixed warm-up must call this climb growth, or this case tests nothing"
    assert growth_findings([*header(True), *loading]) == []
    # served at 130 s, still climbing: the 20 s after it are too few to call growth (30 s are needed)
    assert growth_findings([*header(True), *loading, served_at(130)]) == []


def test_growth_after_the_first_request_is_still_named() -> None:
    """The same engine leaking from its first request on: named, as before."""
    events = [*header(True), served_at(100), *climb(400, mib_per_s=2.0, from_s=100)]
    found = growth_findings(events)
    assert len(found) == 1 and found[0].evidence["memory_class"] == "anon"


def test_an_engine_that_never_serves_is_judged_after_its_longest_start() -> None:
    """No request ever: still starting for ENGINE_START_MAX_S, then judged like any process."""
    short = climb(ENGINE_START_MAX_S - 60, every_s=5.0)
    assert growth_findings([*header(True), *short]) == []
    assert growth_findings([*header(False), *short]), "the fixed warm-up names this climb"
    longer = climb(ENGINE_START_MAX_S + 400, every_s=5.0)
    assert growth_findings([*header(True), *longer])


def test_the_first_request_of_any_process_of_the_run_ends_the_start_up() -> None:
    """The scheduler serves; the tokenizer's process (marked too) is then past its start-up."""
    events = [*header(True), served_at(100, pid=PID + 1), *climb(400, mib_per_s=2.0, from_s=100)]
    assert growth_findings(events)


def test_the_start_up_never_ends_before_the_engine_serves_even_where_memory_held_still() -> None:
    """Flat for 10 s while loading (a pause between shards) would end the start-up; not before serving."""
    params = GrowthParams()
    times = [float(t) for t in range(0, 300)]
    values = [0.0 if t < 30 else (t - 30) * MIB for t in range(0, 300)]
    assert startup_end_s(params, times, values, origin_s=0.0) == 0.0  # held still from the start
    assert startup_end_s(params, times, values, origin_s=0.0, ready_s=200.0) == 200.0
    assert startup_end_s(params, times, values, origin_s=0.0, ready_s=-5.0) == 0.0  # served before: no change
