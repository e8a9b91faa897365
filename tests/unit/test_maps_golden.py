"""The maps the loader resolves, pinned: for every release the release list names and every bound of
every map's range (and releases just before and after each), which map serves it and everything in
that map the probe reads (classes in order, methods in order with their roles, arguments, options,
functions, ranges, dist names, the rows left unhooked), the maps by nearness, each map checked
against the installed SGLang's sources, and `kvdoctor probes` / `kvdoctor probes --table` as
printed. Compared with tests/unit/data/maps_golden.json, written from the per-release map files
before they became one map per engine: the layout of the data may change, what it resolves to not.

Regenerate (only for a change that means to alter what the maps say):
    .venv/bin/python tests/unit/test_maps_golden.py --write
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

import pytest

from kvdoctor.probe.maps.loader import ProbeMap, available_maps, installed_version, known_versions, map_for, maps_by_nearness
from kvdoctor.probe.maps.releases import ci_sentence, releases
from kvdoctor.probe.maps.versions import version_key
from kvdoctor.trace.schema import SERVING_ENGINES

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "maps_golden.json")
# Releases no list names: before every map, past every map, and odd spellings.
EXTRA = ["0.4.9", "0.5.0", "0.5.24", "0.5.24rc1", "0.6.0", "1.0", "0.21.0", "0.23.0", "0.33.1", "0.34.0", "not a version", ""]


def map_dump(probe_map: ProbeMap) -> dict[str, Any]:
    """What the probe reads of a map; lists where order may matter (classes, methods)."""
    return {
        "engine": probe_map.engine,
        "versions": str(probe_map.versions),
        "anchor": probe_map.versions.anchor(),
        "source": probe_map.source,
        "dist_names": list(probe_map.dist_names),
        "speculative_rows_unhooked": list(probe_map.speculative_rows_unhooked),
        "prefill_rows_unhooked": probe_map.prefill_rows_unhooked,
        "hook_count": probe_map.hook_count(),
        "modules": sorted(probe_map.modules()),
        "classes": [
            {
                "module": c.module,
                "class": c.cls,
                "kind": c.kind,
                "methods": [[method, role] for method, role in c.methods.items()],
                "args": {method: dict(sorted(args.items())) for method, args in sorted(c.args.items())},
                "options": dict(sorted(c.options.items())),
            }
            for c in probe_map.classes
        ],
        "functions": [[f.module, f.function, f.role] for f in probe_map.functions],
    }


def probe_versions(engine: str) -> list[str]:
    """The listed releases, each range bound with its neighbours (rc, dev, post), and EXTRA."""
    found = {r.version for r in releases(engine)} | set(EXTRA)
    for probe_map in available_maps(engine):
        bounds = list(probe_map.versions.exact)
        for _op, key in probe_map.versions.clauses:
            bounds.append(".".join(str(p) for p in key[0]) + (f".post{key[3]}" if key[3] >= 0 else ""))
        for bound in bounds:
            base = bound.split(".post")[0]
            found |= {bound, f"{base}rc1", f"{base}.dev0", f"{base}.post1", f"{bound}.post1", f"{bound}.post9"}
    return sorted(found, key=lambda v: (version_key(v) is None, version_key(v) or ((), 0, 0, 0, 0), v))


def resolution() -> dict[str, Any]:
    """Which map each version gets, the maps by nearness, and the maps themselves."""
    out: dict[str, Any] = {"maps": {}, "engines": {}}
    for probe_map in available_maps():
        out["maps"][probe_map.source] = map_dump(probe_map)
    for engine in SERVING_ENGINES:
        per_version = {}
        for version in probe_versions(engine):
            tested = map_for(engine, version)
            per_version[version] = {
                "map": tested.source if tested is not None else None,
                "nearness": [m.source for m in maps_by_nearness(engine, version)],
                "ci": ci_sentence(engine, version),
            }
        out["engines"][engine] = {
            "maps": [m.source for m in available_maps(engine)],
            "known_versions": known_versions(engine),
            "versions": per_version,
        }
    return out


def _probes_output(table: bool, forced: str = "") -> str:
    from kvdoctor.commands.probes import probes

    old = os.environ.get("KVDOCTOR_SGLANG_VERSION")
    if forced:
        os.environ["KVDOCTOR_SGLANG_VERSION"] = forced
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            probes(table=table)
    finally:
        if forced:
            if old is None:
                os.environ.pop("KVDOCTOR_SGLANG_VERSION", None)
            else:
                os.environ["KVDOCTOR_SGLANG_VERSION"] = old
    # the native path and slot history lines say how this checkout was built and set, not what the maps say
    return "\n".join(line for line in buffer.getvalue().splitlines() if not line.startswith(("  native path: ", "  slot history: ")))


FORCED = ["", "0.5.18", "0.5.3.post2", "0.5.99"]


def installed_view() -> dict[str, Any]:
    """What the installed SGLang (0.5.23) makes of each map, and `kvdoctor probes` as printed."""
    from kvdoctor.probe.core.verify import check_map, nearest_resolving_map

    checks = {}
    for probe_map in available_maps("sglang"):
        checks[probe_map.source] = [[h.hook, h.role, h.ledger, h.problem] for h in check_map(probe_map).hooks]
    nearest = {}
    for version in ["0.5.0", "0.5.24", "0.5.99", "0.6.0"]:
        check = nearest_resolving_map("sglang", version)
        nearest[version] = check.probe_map.source if check is not None else None
    return {
        "checks": checks,
        "nearest_resolving": nearest,
        "probes": {forced or "installed": _probes_output(False, forced) for forced in FORCED},
        "probes_table": _probes_output(True),
    }


def snapshot() -> dict[str, Any]:
    return {"resolution": resolution(), "installed_sglang_0_5_23": installed_view()}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    with open(GOLDEN) as fh:
        data: dict[str, Any] = json.load(fh)
    return data


def test_every_release_and_bound_resolves_to_the_pinned_map(golden):
    now = resolution()
    assert now["engines"] == golden["resolution"]["engines"]
    assert now["maps"] == golden["resolution"]["maps"]
    # each map object handed out, not only the list, is the pinned one
    for engine in SERVING_ENGINES:
        for version in golden["resolution"]["engines"][engine]["versions"]:
            tested = map_for(engine, version)
            if tested is not None:
                assert map_dump(tested) == golden["resolution"]["maps"][tested.source], (engine, version)


@pytest.mark.skipif(installed_version("sglang") != "0.5.23", reason="pinned against SGLang 0.5.23 as installed (.ci/setup)")
def test_the_installed_view_and_kvdoctor_probes_are_the_pinned_ones(golden):
    now = installed_view()
    pinned = golden["installed_sglang_0_5_23"]
    assert now["checks"] == pinned["checks"]
    assert now["nearest_resolving"] == pinned["nearest_resolving"]
    for key, text in pinned["probes"].items():
        assert now["probes"][key] == text, key
    assert now["probes_table"] == pinned["probes_table"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: test_maps_golden.py --write")
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as fh:
        json.dump(snapshot(), fh, indent=1, sort_keys=False)
        fh.write("\n")
