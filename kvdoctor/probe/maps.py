"""Loads the versioned probe maps shipped in `probes/` (package data `kvdoctor.probes`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]

MAPS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "probes")


@dataclasses.dataclass
class ClassHooks:
    module: str
    cls: str
    kind: str
    methods: dict[str, str]
    args: dict[str, dict[str, int]]
    options: dict[str, Any]


@dataclasses.dataclass
class FunctionHook:
    module: str
    function: str
    role: str


@dataclasses.dataclass
class ProbeMap:
    engine: str
    versions: list[str]
    classes: list[ClassHooks]
    functions: list[FunctionHook]
    source: str
    dist_names: list[str] = dataclasses.field(default_factory=list)

    def modules(self) -> set[str]:
        return {c.module for c in self.classes} | {f.module for f in self.functions}


def _maps_dir() -> str:
    try:
        import kvdoctor.probes as pkg  # type: ignore[import-not-found,unused-ignore]

        return os.path.dirname(os.path.abspath(str(pkg.__file__)))
    except ImportError:
        return os.path.abspath(MAPS_DIR)


def load_map(path: str) -> ProbeMap:
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    defaults = raw.get("allocator_defaults", {})
    classes = []
    for entry in raw.get("classes", []):
        options = {k: v for k, v in entry.items() if k not in ("module", "class", "kind", "methods", "args")}
        if entry.get("kind") == "allocator":
            options = {**defaults, **options}
        classes.append(
            ClassHooks(
                module=entry["module"],
                cls=entry["class"],
                kind=entry["kind"],
                methods=dict(entry.get("methods", {})),
                args={k: dict(v) for k, v in entry.get("args", {}).items()},
                options=options,
            )
        )
    functions = [FunctionHook(f["module"], f["function"], f["role"]) for f in raw.get("functions", [])]
    return ProbeMap(
        raw["engine"],
        list(raw["versions"]),
        classes,
        functions,
        os.path.basename(path),
        dist_names=list(raw.get("dist_names", [raw["engine"]])),
    )


def available_maps(engine: str | None = None) -> list[ProbeMap]:
    """Every map shipped, or those of one engine."""
    directory = _maps_dir()
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".toml") and (engine is None or name.startswith(engine + "-")):
            out.append(load_map(os.path.join(directory, name)))
    return out


def map_for(engine: str, version: str) -> ProbeMap | None:
    for probe_map in available_maps(engine):
        if version in probe_map.versions:
            return probe_map
    return None


def known_versions(engine: str = "sglang") -> list[str]:
    return [v for m in available_maps(engine) for v in m.versions]
