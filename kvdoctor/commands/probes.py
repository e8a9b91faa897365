"""`kvdoctor probes`: the releases each map covers and CI tests, and what the probe would do with
the engine installed here (its native path, compiled or pure Python, included)."""

from __future__ import annotations

from kvdoctor.errors import EXIT_OK
from kvdoctor.outputs import to_stdout
from kvdoctor.probe.ledgers.history import setting_line
from kvdoctor.runner.support import (
    graph_replays_line,
    installed_graph_replays,
    installed_line,
    installed_pools,
    map_rows,
    markdown_table,
    native_path_line,
    uncovered,
)
from kvdoctor.trace.schema import SERVING_ENGINES


def probes(table: bool = False) -> int:
    if table:
        to_stdout("\n\n".join(markdown_table(engine) for engine in SERVING_ENGINES))
        return EXIT_OK
    lines = ["installed here:", f"  native path: {native_path_line()}", f"  slot history: {setting_line()}"]
    for engine in SERVING_ENGINES:
        lines.append(f"  {installed_line(engine)}")
        lines += [f"    pools {line}" for line in installed_pools(engine)]
        graphs = installed_graph_replays(engine)
        if graphs:
            lines.append(f"    {graphs}")
    for engine in SERVING_ENGINES:
        lines.append(f"{engine} maps:")
        for row in map_rows(engine):
            tested = sum(r.tested for r in row.releases)
            lines.append(
                f"  {row.probe_map.source:26} {str(row.probe_map.versions):26} {row.probe_map.hook_count():3} hooks, "
                f"{tested}/{len(row.releases)} listed releases tested in CI"
            )
            if engine == "sglang":
                lines.append(f"      {graph_replays_line(row.probe_map)}")
            for reason in sorted({r.reason for r in row.releases if not r.tested}):
                versions = ", ".join(r.version for r in row.releases if not r.tested and r.reason == reason)
                lines.append(f"      not tested in CI: {versions}: {reason or 'no reason recorded'}")
        lines += [
            f"  {r.version}: no map covers it (the nearest whose hooks resolve serves it); {r.reason or r.status}"
            for r in uncovered(engine)
        ]
    to_stdout("\n".join(lines))
    return EXIT_OK
