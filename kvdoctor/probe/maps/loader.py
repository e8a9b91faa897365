"""Loads the probe maps shipped in `probes/` (package data `kvdoctor.probes`): one file per engine.

A map names, for a range of an engine's releases, which method of which class plays which role.
An engine's file (`probes/sglang.toml`) lists its maps in `[maps]` (name = the range it covers,
`">=0.5.10,<0.5.16"` or a list of releases) and its hooks once, each with the releases it holds
for (`since`, `until`; a value that changed is a list of ranged values): the map of a range is the
hooks that hold where it starts. A release no map covers is served by the nearest map whose hooks
all resolve in the installed sources (`verify.check_map`).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import sys
from typing import Any

from kvdoctor.probe.maps.versions import VersionKey, VersionRange, release_distance, version_key

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]

MAPS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "..", "probes")


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


_PARSED: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}
_NOT_HERE = object()  # a ranged value none of whose ranges holds for a map
_ENTRY_KEYS = ("module", "class", "kind", "methods", "args", "since", "until")


def _parsed(path: str) -> dict[str, Any]:
    """The file's TOML, read again only when the file changed (the loader is asked often)."""
    stat = os.stat(path)
    stamp = (stat.st_mtime_ns, stat.st_size)
    cached = _PARSED.get(path)
    if cached is None or cached[0] != stamp:
        cached = (stamp, load_toml(path))
        _PARSED[path] = cached
    return cached[1]


def range_start(versions: VersionRange) -> VersionKey:
    """The first release a map's range covers: where `since`/`until` of the file's hooks are read."""
    if versions.exact:
        return min(version_key(v) or ((0,), 0, 0, 0, 0) for v in versions.exact)
    lower = [bound for op, bound in versions.clauses if op in (">=", ">", "==")]
    return max(lower) if lower else ((0,), 0, 0, 0, 0)


class _Reader:
    """One map of an engine file: reads each entry's `since`/`until` (the first release it holds
    for, the first it no longer does) and each ranged value against the map's first release."""

    def __init__(self, path: str, starts: set[VersionKey], start: VersionKey) -> None:
        self.path, self.starts, self.start = path, starts, start

    def _bound(self, text: Any, where: str) -> VersionKey:
        key = version_key(str(text))
        if key is None or key not in self.starts:
            raise ValueError(f"{os.path.basename(self.path)}: {where}: {text!r} is not where one of its [maps] ranges starts")
        return key

    def holds(self, entry: dict[str, Any], where: str) -> bool:
        since, until = entry.get("since"), entry.get("until")
        if since is not None and self.start < self._bound(since, where):
            return False
        return until is None or self.start < self._bound(until, where)

    def pick(self, value: Any, where: str, key: str = "value") -> Any:
        """A plain value, or `{key = V, since = .., until = ..}`, or a list of those (the first whose
        range holds); _NOT_HERE when none holds."""
        cells = value if isinstance(value, list) and value and all(_ranged(v, key) for v in value) else None
        if cells is None and _ranged(value, key):
            cells = [value]
        if cells is None:
            return copy.deepcopy(value)
        for cell in cells:
            if self.holds(cell, where):
                return copy.deepcopy(cell[key])
        return _NOT_HERE

    def values(self, table: dict[str, Any], where: str, key: str = "value") -> dict[str, Any]:
        picked = {name: self.pick(value, f"{where}.{name}", key) for name, value in table.items()}
        return {name: value for name, value in picked.items() if value is not _NOT_HERE}


def _ranged(value: Any, key: str) -> bool:
    return isinstance(value, dict) and key in value and set(value) <= {key, "since", "until"}


def _one_map(path: str, raw: dict[str, Any], name: str, versions: VersionRange, starts: set[VersionKey]) -> ProbeMap:
    read = _Reader(path, starts, range_start(versions))
    defaults = read.values(raw.get("allocator_defaults", {}), "allocator_defaults")
    classes = []
    for entry in raw.get("classes", []):
        where = f"{entry.get('class')} ({entry.get('module')})"
        if not read.holds(entry, where):
            continue
        options = read.values({k: v for k, v in entry.items() if k not in _ENTRY_KEYS}, where)
        if entry.get("kind") == "allocator":
            options = {**defaults, **options}
        args = {m: read.values(a, f"{where} args.{m}") for m, a in entry.get("args", {}).items()}
        classes.append(
            ClassHooks(
                module=entry["module"],
                cls=entry["class"],
                kind=entry["kind"],
                methods=read.values(entry.get("methods", {}), where, key="role"),
                args={m: a for m, a in args.items() if a},
                options=options,
            )
        )
    functions = [
        FunctionHook(f["module"], f["function"], f["role"])
        for f in raw.get("functions", [])
        if read.holds(f, f"{f.get('module')}.{f.get('function')}")
    ]
    top = read.values({k: raw[k] for k in ("dist_names", "speculative_rows_unhooked", "prefill_rows_unhooked") if k in raw}, "")
    return ProbeMap(
        raw["engine"],
        versions,
        classes,
        functions,
        name,
        dist_names=[str(n) for n in top.get("dist_names", [raw["engine"]])],
        speculative_rows_unhooked=[str(n) for n in top.get("speculative_rows_unhooked", [])],
        prefill_rows_unhooked=str(top.get("prefill_rows_unhooked", "")),
    )


def load_maps(path: str) -> list[ProbeMap]:
    """The maps of one engine file (`probes/sglang.toml`): one per range its `[maps]` table names,
    each holding the file's hooks whose `since`/`until` cover the range."""
    raw = _parsed(path)
    ranges = {str(name): VersionRange(spec if isinstance(spec, str) else [str(v) for v in spec]) for name, spec in raw["maps"].items()}
    starts = {range_start(v) for v in ranges.values()}
    return [_one_map(path, raw, name, versions, starts) for name, versions in ranges.items()]


def available_maps(engine: str | None = None) -> list[ProbeMap]:
    """Every map shipped, or those of one engine."""
    directory = maps_dir()
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".toml") and name != "releases.toml" and (engine is None or name == f"{engine}.toml"):
            out += load_maps(os.path.join(directory, name))
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
