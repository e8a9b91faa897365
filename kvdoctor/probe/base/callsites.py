"""Call sites: the few frames above a hooked call, interned as small integers.

A violation names the code path that caused it; walking frames and formatting them on every
call would cost more than the ledger itself, so a site is keyed by the (code object, line) of
the hooked call's caller and its caller, walked once, and turned into text once.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

SITE_DEPTH = 3  # frames named per site
MAX_SITES = 65535  # interned sites per process (bounded); beyond it, "unknown"
MAX_QUICK_KEYS = 65536  # (caller, caller's caller) pairs remembered
PROBE_FRAMES = os.sep + os.path.join("kvdoctor", "probe")


def short_path(filename: str) -> str:
    """A file as a reader finds it: from the package root, not this machine's layout."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    for package in ("/sglang/", "/vllm/", "/kvdoctor/", "/bench/", "/tests/"):
        if package in filename:
            return package[1:] + filename.rsplit(package, 1)[1]
    return os.path.basename(filename)


class CallSites:
    """Interns call sites as small integers; id 0 is "unknown"."""

    def __init__(self) -> None:
        self._ids: dict[tuple[Any, ...], int] = {}
        self._quick: dict[tuple[int, int, int, int], int] = {}
        self._alive: list[tuple[Any, Any]] = []  # the code objects whose ids key `_quick`
        self.names: list[str] = ["unknown"]
        self._lock = threading.Lock()
        # told of each new site (a ledger's crash box writes them down: a crash may follow at once)
        self.on_new: list[Callable[[list[str]], None]] = []

    def intern(self, key: tuple[Any, ...], describe: Callable[[], str]) -> int:
        found = self._ids.get(key)
        if found is not None:
            return found
        with self._lock:
            if key in self._ids:
                return self._ids[key]
            if len(self.names) >= MAX_SITES:
                return 0
            self._ids[key] = found = len(self.names)
            self.names.append(describe())
        for listener in self.on_new:  # rare: once a site, a few hundred bytes written
            try:
                listener(self.names)
            except Exception:
                pass
        return found

    def name(self, site_id: int) -> str:
        return self.names[site_id] if 0 <= site_id < len(self.names) else "unknown"

    def at(self, frame: FrameType) -> int:
        """The site of a call made from `frame` (the hooked method's caller).

        Keyed by the identities of the two innermost code objects and their bytecode offsets:
        hashing a code object hashes its constants (hundreds of ns), and `f_lineno` decodes the
        line table, on every call. The code objects are kept alive beside the key, so an id is
        never reused while its key is remembered."""
        caller = frame.f_back
        code = frame.f_code
        if caller is None:
            quick: tuple[int, int, int, int] = (id(code), frame.f_lasti, 0, -1)
        else:
            quick = (id(code), frame.f_lasti, id(caller.f_code), caller.f_lasti)
        found = self._quick.get(quick)
        if found is not None:
            return found
        found = self._walk(frame)
        if len(self._quick) < MAX_QUICK_KEYS:
            self._quick[quick] = found
            self._alive.append((code, caller.f_code if caller is not None else None))
        return found

    def _walk(self, frame: FrameType | None) -> int:
        frames: list[FrameType] = []
        while frame is not None and len(frames) < SITE_DEPTH:
            if PROBE_FRAMES not in frame.f_code.co_filename:
                frames.append(frame)
            frame = frame.f_back
        key = tuple((f.f_code, f.f_lineno) for f in frames)

        def describe() -> str:
            return " < ".join(f"{f.f_code.co_name} ({short_path(f.f_code.co_filename)}:{f.f_lineno})" for f in frames)

        return self.intern(key, describe)

    def __len__(self) -> int:
        return len(self.names)
