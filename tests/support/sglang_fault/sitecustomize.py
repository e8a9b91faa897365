"""Planted faults for the SGLang server tests (SGLang 0.5.23), and a door for a late probe.

Put this folder on the server's PYTHONPATH (after kvdoctor's inject folder, whose sitecustomize
chains here). KVDOCTOR_TEST_FAULT picks the faults (comma-separated), KVDOCTOR_TEST_FAULT_AT the
call they hit (the Nth call that has slots to work on; `index-out-of-range` with
`stale-last-loc` hits the 2Nth); what was planted is written as JSON, by fault, to
KVDOCTOR_TEST_FAULT_OUT:

- `leak`: the Nth `free_segment` (part of a request's row given back: at its release, or the
  duplicates a tree insert exposed) is skipped;
- `double-free`: the Nth `free_segment` runs twice;
- `stale-last-loc`: the Nth `alloc_decode` whose first request continues a page gets, as that
  request's `last_loc`, a slot in a free page;
- `index-out-of-range`: the same, with -5 (only -1, "no prefix", is legal below 0).

Each planted fault is one call: after it, the host is put back on its own slots (the free list
without the pages a double free listed twice; the right slot after a changed `last_loc`), so
what the probe must count is exactly what was planted, not its later consequences.

Each wrapper is installed when its module is imported, around whatever is there then (kvdoctor's
hook included), so the probe sees the call as the host made it.

With KVDOCTOR_TEST_ATTACH_PARAMS set, SIGUSR2 runs the code `kvdoctor attach` injects (gdb is
what cannot run here), reading its parameters from that file.
"""

import importlib.abc
import json
import os
import signal
import sys
import threading
import time

_FAULTS = {f for f in os.environ.get("KVDOCTOR_TEST_FAULT", "").split(",") if f}
_AT = int(os.environ.get("KVDOCTOR_TEST_FAULT_AT", "0") or 0)
_OUT = os.environ.get("KVDOCTOR_TEST_FAULT_OUT", "")
_ATTACH_PARAMS = os.environ.get("KVDOCTOR_TEST_ATTACH_PARAMS", "")
_MODULES = {
    "sglang.srt.mem_cache.allocator.base": ("leak", "double-free"),
    "sglang.srt.mem_cache.allocator.paged": ("stale-last-loc", "index-out-of-range"),
}
_lock = threading.Lock()
_seen = {}
_planted = {}


def _record(fault, payload):
    payload.update({"pid": os.getpid(), "time_s": time.time()})
    with _lock:
        _planted[fault] = payload
        if _OUT:
            with open(_OUT + ".tmp", "w") as fh:
                json.dump(_planted, fh)
            os.replace(_OUT + ".tmp", _OUT)


def _hit(counter, ready, at):
    """True on the `at`th call of `counter` where `ready` holds."""
    if not ready:
        return False
    with _lock:
        _seen[counter] = _seen.get(counter, 0) + 1
        return _seen[counter] == at


def _dedup_free_list(allocator):
    """After the planted double free: SGLang's free list without the pages it now lists twice, so
    the fault does not turn into double allocations later (what is planted is one call, counted)."""
    if getattr(allocator, "staged_pages", None) and hasattr(allocator, "merge_and_sort_free"):
        allocator.merge_and_sort_free()  # staged pages (need_sort) join the free list first
    for attr in ("free_pages", "release_pages"):
        pages = getattr(allocator, attr, None)
        if pages is not None and pages.numel():
            seen = set()
            keep = [i for i, p in enumerate(pages.tolist()) if not (p in seen or seen.add(p))]
            setattr(allocator, attr, pages[keep])


_dedup_after_group = set()  # allocators whose open free group holds a planted double free


def _patch_free_segment(cls):
    original = cls.free_segment

    def free_segment(self, free_index, *, start_pos):
        fault = "leak" if "leak" in _FAULTS else "double-free"
        if not _hit("free_segment", free_index.numel() > 0, _AT):
            return original(self, free_index, start_pos=start_pos)
        slots = [int(s) for s in free_index.reshape(-1)]
        pages = sorted({s // self.page_size for s in slots})
        _record(fault, {"slot_ids": sorted(slots), "pages": len(pages), "count": len(pages) * self.page_size, "page_size": self.page_size})
        if fault == "leak":
            return None
        original(self, free_index, start_pos=start_pos)
        original(self, free_index, start_pos=start_pos)
        if self.free_group is None:
            _dedup_free_list(self)
        else:  # staged: SGLang applies both at the group's end, where the probe sees them
            _dedup_after_group.add(id(self))
        return None

    cls.free_segment = free_segment


_group_end_depth = threading.local()


def _patch_free_group_end(cls):
    original = cls.free_group_end

    def free_group_end(self):
        depth = getattr(_group_end_depth, "n", 0)
        _group_end_depth.n = depth + 1
        try:
            result = original(self)  # the paged class's calls the base class's first
        finally:
            _group_end_depth.n = depth
        if depth == 0 and id(self) in _dedup_after_group:  # the outermost: every staged page is out
            _dedup_after_group.discard(id(self))
            _dedup_free_list(self)
        return result

    cls.free_group_end = free_group_end


def _patch_base(module):
    _patch_free_segment(module.BaseTokenToKVPoolAllocator)
    _patch_free_group_end(module.BaseTokenToKVPoolAllocator)


def _patch_paged(module):
    cls = module.PagedTokenToKVPoolAllocator
    if _FAULTS & {"leak", "double-free"}:
        if "free_segment" in cls.__dict__:
            _patch_free_segment(cls)
        if "free_group_end" in cls.__dict__:
            _patch_free_group_end(cls)
    if not _FAULTS & {"stale-last-loc", "index-out-of-range"}:
        return
    original = cls.alloc_decode

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        ps = self.page_size
        offset = int(seq_lens_cpu[0] - 1) % ps if len(seq_lens_cpu) else 0
        if offset > 0 and int(last_loc[0]) >= 0:  # the first request continues its last page
            with _lock:
                _seen["alloc_decode"] = n = _seen.get("alloc_decode", 0) + 1
            stale_at = _AT if "stale-last-loc" in _FAULTS else None
            oor_at = (2 * _AT if stale_at else _AT) if "index-out-of-range" in _FAULTS else None
            if n in (stale_at, oor_at):
                good = int(last_loc[0])
                bad = last_loc.clone()
                if n == stale_at:
                    bad[0] = int(self.free_pages[-1]) * ps + offset - 1  # a slot in a page no request holds
                else:
                    bad[0] = -5
                fault = "stale-last-loc" if n == stale_at else "index-out-of-range"
                # -5 as last_loc also makes the allocator hand out -4 (last_loc + 1): two indices
                # outside the buffer in this one call. A stale one hands out a slot mid-page only.
                _record(fault, {"count": 1 if n == stale_at else 2, "last_loc": int(bad[0]), "page_size": ps})
                out = original(self, seq_lens, seq_lens_cpu, bad)
                # The host went on with the right slot: the planted value is one call, seen once.
                if out is not None and out.numel():
                    out[0] = good + 1
                return out
        return original(self, seq_lens, seq_lens_cpu, last_loc)

    cls.alloc_decode = alloc_decode


_PATCHES = {"sglang.srt.mem_cache.allocator.base": _patch_base, "sglang.srt.mem_cache.allocator.paged": _patch_paged}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner = inner
        self.patch = patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Asks the finders after it (kvdoctor's among them, which asks the others in turn, this one
    included: the guard answers None to that inner question) and wraps the loader found."""

    def __init__(self, modules):
        self.modules = modules
        self.busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.modules or getattr(self.busy, "on", False):
            return None
        self.busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader, _PATCHES[fullname])
                    return spec
        finally:
            self.busy.on = False
        return None


def _attach(_signum, _frame):
    from kvdoctor.collect.attach_code import INJECTED

    with open(_ATTACH_PARAMS) as fh:
        params = fh.read()
    exec(compile(INJECTED, "<kvdoctor attach>", "exec"), {"__name__": "__kvdoctor_attach__", "_KVDOCTOR_ATTACH_PARAMS": params})


if _FAULTS and _AT > 0:
    wanted = {name for name, faults in _MODULES.items() if _FAULTS & set(faults)}
    sys.meta_path.insert(0, _Finder(wanted))
if _ATTACH_PARAMS:
    signal.signal(signal.SIGUSR2, _attach)
