"""Release numbers and the ranges a map covers, without a packaging dependency inside the server.

Enough of PEP 440 for engine releases: `0.5.15`, `0.5.15.post1`, `0.5.24rc1`, `0.5.24.dev3`, and
ranges written as comma-separated clauses (`>=0.5.10,<0.5.16`, `==0.5.9`, `!=0.5.12`).
"""

from __future__ import annotations

import re

_VERSION = re.compile(r"^\s*v?(\d+(?:\.\d+)*)(?:[.-]?(a|b|rc)(\d*))?(?:[.-]?post(\d*))?(?:[.-]?dev(\d*))?(?:\+[\w.]*)?\s*$", re.I)
_CLAUSE = re.compile(r"^\s*(==|!=|>=|<=|>|<)\s*([\w.+-]+)\s*$")
_PRE_RANK = {"dev": -3, "a": -2, "b": -1, "rc": 0}

VersionKey = tuple[tuple[int, ...], int, int, int, int]


def version_key(text: str) -> VersionKey | None:
    """An orderable key for a release string; None if it is not one."""
    match = _VERSION.match(text or "")
    if not match:
        return None
    release_text, pre, pre_n, post, dev = match.groups()
    release = tuple(int(p) for p in release_text.split("."))
    release = release + (0,) * (4 - len(release)) if len(release) < 4 else release
    if pre:
        pre_rank, pre_number = _PRE_RANK[pre.lower()], int(pre_n or 0)
    elif dev is not None and post is None:
        pre_rank, pre_number = _PRE_RANK["dev"], 0
    else:
        pre_rank, pre_number = 1, 0  # a final release sorts after its pre-releases
    post_number = int(post or 0) if post is not None else -1
    dev_number = int(dev or 0) if dev is not None else 1 << 30
    return (release, pre_rank, pre_number, post_number, dev_number)


def release_distance(a: str, b: str) -> float:
    """How far apart two releases are, for choosing the nearest map: minor releases weigh more than
    patches, post releases least."""
    ka, kb = version_key(a), version_key(b)
    if ka is None or kb is None:
        return float("inf")
    ra, rb = ka[0], kb[0]
    weights = (1e9, 1e6, 1e3, 1.0)
    distance = sum(abs(x - y) * w for x, y, w in zip(ra[:4], rb[:4], weights, strict=False))
    return distance + abs(ka[3] - kb[3]) * 1e-3


class VersionRange:
    """The releases a map covers: an explicit list, or clauses all of which must hold."""

    def __init__(self, spec: str | list[str]) -> None:
        self.text = spec if isinstance(spec, str) else ", ".join(spec)
        self.exact: list[str] = []
        self.clauses: list[tuple[str, VersionKey]] = []
        if isinstance(spec, list):
            self.exact = [str(v) for v in spec]
            return
        for part in spec.split(","):
            match = _CLAUSE.match(part)
            key = version_key(match.group(2)) if match else None
            if match is None or key is None:
                raise ValueError(f"unreadable version range {spec!r} (clause {part.strip()!r})")
            self.clauses.append((match.group(1), key))

    def __contains__(self, version: str) -> bool:
        if self.exact:
            return version in self.exact
        key = version_key(version)
        if key is None or not self.clauses:
            return False
        return all(_holds(op, key, bound) for op, bound in self.clauses)

    def anchor(self) -> str:
        """A release to measure distance from: the newest listed, or the range's lower bound."""
        if self.exact:
            return max(self.exact, key=lambda v: version_key(v) or ((0,), 0, 0, 0, 0))
        lower = [b for op, b in self.clauses if op in (">=", ">", "==")]
        bound = max(lower) if lower else min(b for _, b in self.clauses)
        post = f".post{bound[3]}" if bound[3] >= 0 else ""
        return ".".join(str(p) for p in bound[0]) + post

    def __str__(self) -> str:
        return self.text


def _holds(op: str, key: VersionKey, bound: VersionKey) -> bool:
    if op == "==":
        return key == bound
    if op == "!=":
        return key != bound
    if op == ">=":
        return key >= bound
    if op == ">":
        return key > bound
    if op == "<=":
        return key <= bound
    return key < bound
