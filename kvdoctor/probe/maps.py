"""Loads the versioned probe maps shipped in `probes/` (package data `kvdoctor.probes`).

A map names, for a range of an engine's releases, which method of which class plays which role.
`versions` is a list of releases or a range (`">=0.5.10,<0.5.16"`). A release no map covers is
served by the nearest map whose hooks all resolve in the installed sources (`verify.check_map`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any

from kvdoctor.probe.versions import VersionRange, release_distance, version_key

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
    versions: VersionRange
    classes: list[ClassHooks]
    functions: list[FunctionHook]
    source: str
    dist_names: list[str] = dataclasses.field(default_factory=list)
    # speculative decoding algorithms whose request rows a kernel writes in place, past the hooked row writer
    speculative_rows_unhooked: list[str] = dataclasses.field(default_factory=list)
    # where a prefill batch's request rows are written by a kernel launched in place, past every hook
    # ('' when a hooked writer sees them): the caller and the kernel, said in the not-judged reason
    prefill_rows_unhooked: str = ""

    def modules(self) -> set[str]:
        return {c.module for c in self.classes} | {f.module for f in self.functions}

    def covers(self, version: str) -> bool:
        return version in self.versions

    def hook_count(self) -> int:
        return sum(len(c.methods) for c in self.classes) + len(self.functions)


def maps_dir() -> str:
    """The maps of the kvdoctor being run: `probes/` beside the package in a source checkout (an
    editable install's package data points at the checkout it was made from, which need not be
    this one), else the installed package data."""
    if os.path.isfile(os.path.join(MAPS_DIR, "releases.toml")):
        return os.path.abspath(MAPS_DIR)
    try:
        import kvdoctor.probes as pkg  # type: ignore[import-not-found,unused-ignore]

        return os.path.dirname(os.path.abspath(str(pkg.__file__)))
    except ImportError:
        return os.path.abspath(MAPS_DIR)


def load_toml(path: str) -> dict[str, Any]:
    with open(path, "rb") as fh:
        raw: dict[str, Any] = tomllib.load(fh)
    return raw


def load_map(path: str) -> ProbeMap:
    raw = load_toml(path)
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
        VersionRange(raw["versions"] if isinstance(raw["versions"], str) else [str(v) for v in raw["versions"]]),
        classes,
        functions,
        os.path.basename(path),
        dist_names=list(raw.get("dist_names", [raw["engine"]])),
        speculative_rows_unhooked=[str(name) for name in raw.get("speculative_rows_unhooked", [])],
        prefill_rows_unhooked=str(raw.get("prefill_rows_unhooked", "")),
    )


def available_maps(engine: str | None = None) -> list[ProbeMap]:
    """Every map shipped, or those of one engine."""
    directory = maps_dir()
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".toml") and name != "releases.toml" and (engine is None or name.startswith(engine + "-")):
            out.append(load_map(os.path.join(directory, name)))
    return sorted(out, key=lambda m: version_key(m.versions.anchor()) or ((), 0, 0, 0, 0))


def map_for(engine: str, version: str) -> ProbeMap | None:
    """The map tested for `version` (one whose range covers it), or None."""
    for probe_map in available_maps(engine):
        if probe_map.covers(version):
            return probe_map
    return None


def maps_by_nearness(engine: str, version: str) -> list[ProbeMap]:
    """The engine's maps, nearest release first (for a release no map covers)."""
    return sorted(available_maps(engine), key=lambda m: release_distance(version, m.versions.anchor()))


def known_versions(engine: str) -> list[str]:
    return [str(m.versions) for m in available_maps(engine)]


def forced_version_env(engine: str) -> str:
    """Tests only: `KVDOCTOR_SGLANG_VERSION=0.5.9` makes the probe believe that version is installed."""
    return f"KVDOCTOR_{engine.upper()}_VERSION"


def _version_file(engine: str) -> str:
    """`__version__` of the engine's `_version.py`, run alone: importing `{engine}._version` would
    run the package's `__init__` first (SGLang's imports torch and transformers, 10 to 40 s), for a
    `kvdoctor probes` or a test that only asks which release is installed."""
    import importlib.util

    spec = importlib.util.find_spec(engine)  # a top-level name: found, not imported
    folder = os.path.dirname(spec.origin) if spec is not None and spec.origin else ""
    path = os.path.join(folder, "_version.py")
    loader_spec = importlib.util.spec_from_file_location(f"_kvdoctor_{engine}_version", path)
    if not folder or loader_spec is None or loader_spec.loader is None or not os.path.isfile(path):
        raise LookupError(f"no {engine}/_version.py")
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    return str(module.__version__)


def installed_version(engine: str) -> str:
    """The engine's version as its package reports it ("" when it cannot be read), or the one a
    test forces (`forced_version_env`)."""
    forced = os.environ.get(forced_version_env(engine))
    if forced:
        return forced
    try:
        if engine in sys.modules:
            return str(importlib.import_module(f"{engine}._version").__version__)
        return _version_file(engine)
    except Exception:
        pass
    from importlib.metadata import PackageNotFoundError, version

    names = [engine] + [n for m in available_maps(engine) for n in m.dist_names if n != engine]
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
        except Exception:
            break
    return ""
