"""Which engine releases kvdoctor supports, and what the probe would do with the one installed.

Read from the maps (`probes/*.toml`) and the release list (`probes/releases.toml`) that the release
matrix tests; nothing is imported from the engine (its sources are parsed), so this is safe to run
in a production environment.
"""

from __future__ import annotations

import dataclasses

from kvdoctor.probe.core.hooks import REGISTRY
from kvdoctor.probe.core.patching import ENGINE_LABELS
from kvdoctor.probe.core.verify import MapCheck, check_map, nearest_resolving_map
from kvdoctor.probe.engines.sglang.hicache_graphs import GraphReplayRole
from kvdoctor.probe.maps.loader import ProbeMap, available_maps, installed_version, map_for
from kvdoctor.probe.maps.releases import Release, ci_sentence, release, releases
from kvdoctor.probe.native import CHOICE as NATIVE_PATH
from kvdoctor.runner.pools import pool_classes, summary


@dataclasses.dataclass
class MapRow:
    """One map and the listed releases it covers."""

    probe_map: ProbeMap
    releases: list[Release]


def map_rows(engine: str) -> list[MapRow]:
    listed = [release(engine, r.version) or r for r in releases(engine)]
    return [MapRow(m, [r for r in listed if m.covers(r.version)]) for m in available_maps(engine)]


def uncovered(engine: str) -> list[Release]:
    """Listed releases no map's range covers (served by the nearest map that resolves)."""
    maps = available_maps(engine)
    return [r for r in releases(engine) if not any(m.covers(r.version) for m in maps)]


def installed_check(engine: str) -> tuple[str, ProbeMap | None, MapCheck | None]:
    """The installed release of `engine` ("" if none), the map tested on it (None if none) and the
    check of the map the probe would use there against its sources."""
    version = installed_version(engine)
    if not version:
        return "", None, None
    tested = map_for(engine, version)
    return version, tested, check_map(tested) if tested is not None else nearest_resolving_map(engine, version)


def installed_line(engine: str) -> str:
    """What the probe would do with the installed release of `engine`, in one line."""
    label = ENGINE_LABELS.get(engine, engine)
    version, tested, check = installed_check(engine)
    if not version:
        return f"{label}: not installed here"
    if check is None:
        return f"{label} {version}: no map; the probe stays off"
    how = "map" if tested is not None else "no map of its own; nearest"
    total = len(check.hooks)
    line = f"{label} {version}: {how} {check.probe_map.source}, {check.resolved_count}/{total} hooks resolve"
    off = check.ledgers_off()
    if off and set(off) >= set(check.ledgers()):
        line += "; every ledger off, the probe stays off"
    elif off:
        line += "; " + ", ".join(f"{ledger} ledger off" for ledger in sorted(off))
    ci = ci_sentence(engine, version) or ("not in the release list" if tested is None else "")
    return f"{line}, {ci}" if ci else line


def graph_replay_hooks(probe_map: ProbeMap) -> list[str]:
    """The map's graph runner hooks ("Class.method"): the replays graph_replay_during_load and
    graph-guard see (SGLang's HiCache; none in a vLLM map)."""
    REGISTRY.load(probe_map.engine)
    return [
        f"{spec.cls}.{method}"
        for spec in probe_map.classes
        for method, role in spec.methods.items()
        if isinstance(REGISTRY.get(role), GraphReplayRole)
    ]


def graph_replays_line(probe_map: ProbeMap, check: MapCheck | None = None) -> str:
    """Whether graph replays are watched under this map (with `check`, in the sources installed):
    without a hook, a replay during a HiCache load is neither named nor guarded."""
    hooks = graph_replay_hooks(probe_map)
    if not hooks:
        return "graph replays: not watched: no graph runner hook in this map"
    off = check.ledgers_off().get("hicache") if check is not None else None
    if off:
        return f"graph replays: not watched: the hicache ledger is off ({'; '.join(off[:2])})"
    return f"graph replays: watched ({', '.join(hooks)})"


def installed_graph_replays(engine: str) -> str:
    """`graph_replays_line` for the installed release of SGLang ("" for another engine or none)."""
    if engine != "sglang":
        return ""
    _version, _tested, check = installed_check(engine)
    return graph_replays_line(check.probe_map, check) if check is not None else ""


def native_path_line() -> str:
    """The probe's native path in this installation: compiled, or pure Python and why (several times
    the cost per hooked call: it must never go unsaid)."""
    return NATIVE_PATH.describe()


def installed_pools(engine: str) -> list[str]:
    """The installed engine's pool classes by what the probe makes of them (SGLang only: vLLM's
    block pool is one class the map names)."""
    version = installed_version(engine)
    if engine != "sglang" or not version:
        return []
    probe_map = map_for(engine, version)
    if probe_map is None:
        check = nearest_resolving_map(engine, version)
        probe_map = check.probe_map if check is not None else None
    return summary(pool_classes(probe_map)) if probe_map is not None else []


def _status_text(entry: Release) -> str:
    if entry.same_as:
        return f"{entry.version} (= {entry.same_as})"
    if entry.scope:
        return f"{entry.version} (GPU wheel: BlockPool, KVCacheManager)"
    return entry.version


def markdown_table(engine: str) -> str:
    """The README's supported-releases table for `engine`."""
    graphs = engine == "sglang"
    lines = [
        "| releases | map | hooks | in the release matrix |" + (" graph replays watched |" if graphs else ""),
        "|---|---|---|---|" + ("---|" if graphs else ""),
    ]
    for row in map_rows(engine):
        tested = [r for r in row.releases if r.tested]
        others = [r for r in row.releases if not r.tested]
        listed = ", ".join(_status_text(r) for r in row.releases) or str(row.probe_map.versions)
        verdict = f"{len(tested)} tested" if tested else "none"
        reasons = sorted({r.reason for r in others if r.reason})
        if others:
            verdict += f"; not run: {', '.join(r.version for r in others)}" + (f" ({'; '.join(reasons)})" if reasons else "")
        line = f"| {listed} | `{row.probe_map.source}` | {row.probe_map.hook_count()} | {verdict} |"
        if graphs:
            line += f" {', '.join(f'`{hook}`' for hook in graph_replay_hooks(row.probe_map)) or 'none'} |"
        lines.append(line)
    return "\n".join(lines)
