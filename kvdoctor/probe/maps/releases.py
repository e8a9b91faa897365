"""What CI does with each release of an engine (`probes/releases.toml`): tested in the release
matrix, the same `mem_cache/` as a tested one, or not runnable here, with the one sentence why.

The probe reads it to say, when it meets a release CI could not run, the same sentence the README
and `kvdoctor probes` say.
"""

from __future__ import annotations

import dataclasses
import os

from kvdoctor.probe.maps.loader import load_toml, maps_dir
from kvdoctor.probe.maps.versions import version_key

RELEASES_FILE = "releases.toml"


@dataclasses.dataclass(frozen=True)
class Release:
    version: str
    status: str  # tested | same_as | not_run
    reason: str = ""
    same_as: str = ""
    transformers: str = ""  # the pin it needs beside it to import, where the environment's does not do
    scope: str = ""  # "" (the whole of it) or "block_pool" (vLLM's GPU wheel: BlockPool and KVCacheManager only)

    @property
    def tested(self) -> bool:
        return self.status == "tested"


def releases(engine: str) -> list[Release]:
    """Every release of `engine` the file lists, oldest first ([] when it lists none)."""
    try:
        table = load_toml(os.path.join(maps_dir(), RELEASES_FILE)).get(engine, {})
    except (OSError, ValueError):
        return []
    out = [
        Release(
            str(v),
            str(e.get("status", "")),
            str(e.get("reason", "")),
            str(e.get("same_as", "")),
            str(e.get("transformers", "")),
            str(e.get("scope", "")),
        )
        for v, e in table.items()
    ]
    return sorted(out, key=lambda r: version_key(r.version) or ((), 0, 0, 0, 0))


def release(engine: str, version: str) -> Release | None:
    """The release's entry, with `same_as` followed to the release CI ran in its place."""
    by_version = {r.version: r for r in releases(engine)}
    entry = by_version.get(version)
    seen = {version}
    while entry is not None and entry.status == "same_as" and entry.same_as not in seen:
        seen.add(entry.same_as)
        target = by_version.get(entry.same_as)
        if target is None:
            break
        entry = dataclasses.replace(target, version=version, same_as=target.version)
    return entry


def ci_sentence(engine: str, version: str) -> str:
    """ "tested in CI" / "not tested in CI: <why>" / "" (a release the file does not list)."""
    entry = release(engine, version)
    if entry is None:
        return ""
    if entry.tested:
        scope = " (BlockPool and KVCacheManager only: its engine needs CUDA)" if entry.scope == "block_pool" else ""
        return "tested in CI" + (f" (as {entry.same_as}, the same mem_cache/)" if entry.same_as else scope)
    return f"not tested in CI: {entry.reason}" if entry.reason else "not tested in CI"
