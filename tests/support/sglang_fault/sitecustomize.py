"""Planted faults for the SGLang server tests (SGLang 0.5.23), and a door for a late probe.

Put this folder on the server's PYTHONPATH (after kvdoctor's inject folder, whose sitecustomize
chains here). KVDOCTOR_TEST_FAULT picks the faults (comma-separated), KVDOCTOR_TEST_FAULT_AT the
call they hit (the Nth call that has slots to work on; `index-out-of-range` with
`stale-last-loc` hits the 2Nth); what was planted is written as JSON, by fault, to
KVDOCTOR_TEST_FAULT_OUT (a leak may be planted twice: "N,+M" also skips the Mth after the attach):

- `leak`: the Nth `free_segment` (part of a request's row given back: at its release, or the
  duplicates a tree insert exposed) is skipped;
- `double-free`: the Nth `free_segment` runs twice;
- `swa-leak`: on a sliding-window pool, the SWA side of the Nth segment a request gives back
  (`SWATokenToKVPoolAllocator.free_segment`'s `free_swa_segment`) is skipped, its full side freed:
  its SWA slots stay allocated, still mapped from the freed full slots (KVDOCTOR_TEST_FAULT_SWA_AT,
  if set, picks the call instead of KVDOCTOR_TEST_FAULT_AT);
- `row-leak`: the Nth request pool `free(req)` (`ReqToTokenPool`'s, or a decode server's
  `DecodeReqToTokenPool`'s) is skipped: the request's slots went back, its row never
  (KVDOCTOR_TEST_FAULT_ROW_AT, if set, picks the call instead of KVDOCTOR_TEST_FAULT_AT);
- `mamba-leak`: on a hybrid model's request pool, the Nth `HybridReqToTokenPool.free_mamba_cache(req)`
  (a request's Mamba state slot given back at its release) is skipped: the slot stays allocated,
  held by nobody (KVDOCTOR_TEST_FAULT_MAMBA_AT, if set, picks the call instead of KVDOCTOR_TEST_FAULT_AT);
- `stale-last-loc`: the Nth `alloc_decode` whose first request continues a page gets, as that
  request's `last_loc`, a slot in a free page;
- `index-out-of-range`: the same, with -5 (only -1, "no prefix", is legal below 0). With
  KVDOCTOR_TEST_FAULT_OOR=past-end it is the KV buffer's row count (one past its last row) instead,
  and the host is not put back: the allocator hands out the row after it, and the KV write goes
  past the buffer's end (what compute-sanitizer's memcheck sees, the GPU server suite's
  `sanitizer-*` cases).

Each planted fault is one call: after it, the host is put back on its own slots (the free list
without the pages a double free listed twice; the right slot after a changed `last_loc`), so
what the probe must count is exactly what was planted, not its later consequences.

Each wrapper is installed when its module is imported, around whatever is there then (kvdoctor's
hook included), so the probe sees the call as the host made it.

With KVDOCTOR_TEST_ATTACH_PARAMS set, SIGUSR2 runs the code `kvdoctor attach` injects (gdb is
what cannot run here), reading its parameters from that file.
"""

import functools
import importlib.abc
import json
import os
import signal
import sys
import threading
import time

_FAULTS = {f for f in os.environ.get("KVDOCTOR_TEST_FAULT", "").split(",") if f}
# "N" or "N,+M": the Nth call, and (a leak only) also the Mth after the late probe went in
_AT_SPEC = [a for a in os.environ.get("KVDOCTOR_TEST_FAULT_AT", "0").split(",") if a]
_AT = int(_AT_SPEC[0] or 0) if _AT_SPEC else 0
_AT_AFTER_ATTACH = int(_AT_SPEC[1].lstrip("+")) if len(_AT_SPEC) > 1 else 0
_SWA_AT = int(os.environ.get("KVDOCTOR_TEST_FAULT_SWA_AT", "0") or 0) or _AT
_ROW_AT = int(os.environ.get("KVDOCTOR_TEST_FAULT_ROW_AT", "0") or 0) or _AT
_MAMBA_AT = int(os.environ.get("KVDOCTOR_TEST_FAULT_MAMBA_AT", "0") or 0) or _AT
_OOR_PAST_END = os.environ.get("KVDOCTOR_TEST_FAULT_OOR") == "past-end"
_attached = threading.Event()
_OUT = os.environ.get("KVDOCTOR_TEST_FAULT_OUT", "")
_ATTACH_PARAMS = os.environ.get("KVDOCTOR_TEST_ATTACH_PARAMS", "")
_MODULES = {
    "sglang.srt.mem_cache.allocator.base": ("leak", "double-free"),
    "sglang.srt.mem_cache.allocator.paged": ("leak", "double-free", "stale-last-loc", "index-out-of-range"),
    "sglang.srt.mem_cache.allocator.swa": ("swa-leak",),
    "sglang.srt.mem_cache.memory_pool": ("row-leak", "mamba-leak"),
    "sglang.srt.disaggregation.decode": ("row-leak",),
}
_lock = threading.Lock()
_seen = {}
_planted = {}


def _record(fault, payload):
    """One planted fault; a second of the same kind (a leak after the attach) adds to the first,
    each kept in `plants` with whether the late probe was in by then."""
    payload.update({"pid": os.getpid(), "time_s": time.time(), "after_attach": _attached.is_set()})
    with _lock:
        before = _planted.get(fault)
        plants = [*before["plants"], dict(payload)] if before else [dict(payload)]
        if before:
            payload = {**payload, "slot_ids": sorted(before["slot_ids"] + payload["slot_ids"]), "count": before["count"] + payload["count"]}
        _planted[fault] = {**payload, "plants": plants}
        if _OUT:
            with open(_OUT + ".tmp", "w") as fh:
                json.dump(_planted, fh)
            os.replace(_OUT + ".tmp", _OUT)


def _hit(counter, ready, at, after_attach=0, ready_after=True):
    """True on the `at`th call of `counter` where `ready` holds, and on the `after_attach`th such
    call after the late probe went in where `ready_after` holds too."""
    if not ready:
        return False
    with _lock:
        _seen[counter] = _seen.get(counter, 0) + 1
        if after_attach and _attached.is_set() and ready_after:
            _seen[counter + "/attached"] = _seen.get(counter + "/attached", 0) + 1
            if _seen[counter + "/attached"] == after_attach:
                return True
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


def _called_from_tree():
    """A radix tree frees what it evicts and the duplicates an insert exposed; the leak after an
    attach is planted in a request's own release instead (the part of its row no tree keeps)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        if "radix_cache" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


_dedup_after_group = set()  # allocators whose open free group holds a planted double free


_inner = threading.local()  # set while an outer fault wrapper runs: the inner one passes through
_patched = []  # (class, patcher): wrapped again, outermost, once a late probe has hooked them


def _patch_free_segment(cls):
    original = cls.free_segment
    if not any(c is cls and p is _patch_free_segment for c, p in _patched):
        _patched.append((cls, _patch_free_segment))

    def free_segment(self, free_index, *, start_pos):
        if getattr(_inner, "on", False):
            return original(self, free_index, start_pos=start_pos)
        _inner.on = True
        try:
            return _free_segment(self, free_index, start_pos)
        finally:
            _inner.on = False

    def _free_segment(self, free_index, start_pos):
        fault = "leak" if "leak" in _FAULTS else "double-free"
        after = _AT_AFTER_ATTACH if "leak" in _FAULTS else 0
        if not _hit("free_segment", free_index.numel() > 0, _AT, after, after and not _called_from_tree()):
            return original(self, free_index, start_pos=start_pos)
        slots = [int(s) for s in free_index.reshape(-1)]
        pages = sorted({s // self.page_size for s in slots})
        payload = {"slot_ids": sorted(slots), "pages": len(pages), "count": len(pages) * self.page_size, "page_size": self.page_size}
        _record(fault, {**payload, "rid": _request_in_frames()})
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
    if not any(c is cls and p is _patch_free_group_end for c, p in _patched):
        _patched.append((cls, _patch_free_group_end))

    def free_group_end(self):
        if getattr(_inner, "on", False):
            return original(self)
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


def _count(key):
    """One call a wrapper saw, by kind, written beside the fault's file (`-seen.json`): where a
    planted fault never fired, this says what the host called instead."""
    if not _OUT:
        return
    with _lock:
        _seen[key] = _seen.get(key, 0) + 1
        _write_seen()


def _write_seen():
    with open(_OUT[: -len(".json")] + "-seen.json" if _OUT.endswith(".json") else _OUT + ".seen", "w") as fh:
        json.dump(_seen, fh)


def _count_call(offset, last_loc):
    """Every alloc_decode this wrapper saw, and why it did not count (beside the fault's file, as
    `-seen.json`, every 16 calls): where a planted fault never fired, this says how far it got."""
    if not _OUT:
        return
    with _lock:
        key = "calls" if offset > 0 and int(last_loc[0]) >= 0 else ("page_start" if offset == 0 else "no_prefix")
        _seen[key] = _seen.get(key, 0) + 1
        if sum(v for k, v in _seen.items() if k in ("calls", "page_start", "no_prefix")) % 16 == 1:
            _write_seen()


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
        _count_call(offset, last_loc)
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
                elif _OOR_PAST_END:
                    bad[0] = self.size + ps  # the KV buffer's rows: one past its last
                else:
                    bad[0] = -5
                fault = "stale-last-loc" if n == stale_at else "index-out-of-range"
                # -5 as last_loc also makes the allocator hand out -4 (last_loc + 1): two indices
                # outside the buffer in this one call. A stale one hands out a slot mid-page only.
                _record(fault, {"count": 1 if n == stale_at else 2, "last_loc": int(bad[0]), "page_size": ps})
                out = original(self, seq_lens, seq_lens_cpu, bad)
                if _OOR_PAST_END and n == oor_at:
                    return out  # kept: the KV write goes past the buffer
                # The host went on with the right slot: the planted value is one call, seen once.
                if out is not None and out.numel():
                    out[0] = good + 1
                return out
        return original(self, seq_lens, seq_lens_cpu, last_loc)

    cls.alloc_decode = alloc_decode


def _request_in_frames():
    frame = sys._getframe(2)
    for _ in range(32):
        if frame is None:
            return ""
        rid = getattr(frame.f_locals.get("req"), "rid", None) if "req" in frame.f_code.co_varnames else None
        if isinstance(rid, str):
            return rid
        frame = frame.f_back
    return ""


def _patch_swa(module):
    cls = module.SWATokenToKVPoolAllocator
    original = cls.free_swa_segment

    def free_swa_segment(self, free_index, *, start_pos):
        caller = sys._getframe(1).f_code.co_name
        from_release = caller == "free_segment"  # a row's segment, not the window's slide
        _count("free_swa_segment from " + caller + ("" if free_index.numel() else " (empty)"))
        if type(self) is not cls or not _hit("free_swa_segment", from_release and free_index.numel() > 0, _SWA_AT):
            return original(self, free_index, start_pos=start_pos)
        full = [int(s) for s in free_index.reshape(-1)]
        swa = [int(s) for s in self.full_to_swa_index_mapping[free_index].reshape(-1) if int(s) > 0]
        _record("swa-leak", {"slot_ids": sorted(swa), "full_slot_ids": sorted(full), "count": len(swa), "rid": _request_in_frames()})
        return None

    cls.free_swa_segment = free_swa_segment


def _patch_row_free(cls):
    original = cls.free

    @functools.wraps(original)  # the release path not calling it, as the probe's coverage sees it: the hook stays in place
    def free(self, req):
        row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
        if type(self) is not cls or not _hit("row_free", isinstance(row, int), _ROW_AT):
            return original(self, req)
        _record("row-leak", {"slot_ids": [row], "count": 1, "rid": str(getattr(req, "rid", ""))})
        return None

    cls.free = free


def _patch_mamba_free(cls):
    original = cls.free_mamba_cache

    def free_mamba_cache(self, req, *args, **kwargs):
        slot = getattr(getattr(req, "kv", None), "mamba_pool_idx", None)
        if not _hit("mamba_free", slot is not None, _MAMBA_AT):
            return original(self, req, *args, **kwargs)
        _record("mamba-leak", {"slot_ids": [int(slot)], "count": 1, "rid": str(getattr(req, "rid", ""))})
        req.kv.mamba_pool_idx = None  # what the skipped call would have done to the request, its slot not freed
        return None

    cls.free_mamba_cache = free_mamba_cache


def _patch_memory_pool(module):
    if "row-leak" in _FAULTS:
        _patch_row_free(module.ReqToTokenPool)
    if "mamba-leak" in _FAULTS and hasattr(module, "HybridReqToTokenPool"):
        _patch_mamba_free(module.HybridReqToTokenPool)


_PATCHES = {
    "sglang.srt.mem_cache.allocator.base": _patch_base,
    "sglang.srt.mem_cache.allocator.paged": _patch_paged,
    "sglang.srt.mem_cache.allocator.swa": _patch_swa,
    "sglang.srt.mem_cache.memory_pool": _patch_memory_pool,
    "sglang.srt.disaggregation.decode": lambda module: _patch_row_free(module.DecodeReqToTokenPool),
}


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
    from kvdoctor.delivery.attach_code import INJECTED

    with open(_ATTACH_PARAMS) as fh:
        params = fh.read()
    exec(compile(INJECTED, "<kvdoctor attach>", "exec"), {"__name__": "__kvdoctor_attach__", "_KVDOCTOR_ATTACH_PARAMS": params})
    threading.Thread(target=_after_attach, args=(json.loads(params)["status_path"],), daemon=True).start()


def _after_attach(status_path):
    """Once the late probe is in (its thread reports), it has wrapped the faulty methods: wrap them
    again, so that a fault after the attach is, as before it, what the host did and the probe saw."""
    deadline = time.monotonic() + 120
    while not os.path.exists(status_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    for cls, patch in list(_patched):
        patch(cls)
    _attached.set()


if _FAULTS and _AT > 0:
    wanted = {name for name, faults in _MODULES.items() if _FAULTS & set(faults)}
    sys.meta_path.insert(0, _Finder(wanted))


def _rewrap(_signum, _frame):
    """A probe put in from outside (`kvdoctor attach` through a debugger) wrapped the faulty methods:
    wrap them again, as `_after_attach` does for the signal's own attach."""
    for cls, patch in list(_patched):
        patch(cls)
    _attached.set()


if _ATTACH_PARAMS:
    signal.signal(signal.SIGUSR2, _attach)
elif os.environ.get("KVDOCTOR_TEST_FAULT_REWRAP_SIGNAL") == "1":
    signal.signal(signal.SIGUSR2, _rewrap)

if os.environ.get("KVDOCTOR_TEST_LFM2_STANDINS") == "1":
    import lfm2_standins  # noqa: F401  (tests/support: the tiny LFM2's layer math in torch)
