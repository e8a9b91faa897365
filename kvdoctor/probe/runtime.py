"""The probe's runtime: finds SGLang's classes as they are imported, wraps the methods a
versioned map names, and feeds the slot ledger from each call.

Every wrapper calls the host's original method exactly once, with the host's own arguments, and
returns its result untouched. The probe's own work runs in `try` blocks: a failure turns the
ledger off for this process, records why in the trace, and the server goes on as without us.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

from kvdoctor.trace import schema
from kvdoctor.probe import fixes
from kvdoctor.probe.emitter import Emitter
from kvdoctor.probe.ledger.slots import CallSites, RequestTable, SlotLedger
from kvdoctor.probe.maps import ClassHooks, ProbeMap, available_maps, known_versions, map_for

ENV_TRACE = "KVDOCTOR_TRACE"
ENV_FIXES = "KVDOCTOR_FIXES"
ENV_INJECT = "KVDOCTOR_INJECT_FAULT"   # tests only: make named roles' handlers raise
ENV_DISABLE = "KVDOCTOR_DISABLE"
ENV_FORCE_VERSION = "KVDOCTOR_SGLANG_VERSION"  # tests only: pretend SGLang has this version

WATCHED_PREFIX = "sglang.srt."
SITE_DEPTH = 3

# Roles that compose inside one allocator (free_segment -> free_page_ids -> free): only the
# outermost of these on the same object is recorded.
COMPOSITE_ROLES = {"alloc", "alloc_extend", "alloc_decode", "free", "free_segment", "free_pages", "clear"}
ROLES_WITH_SITE = {"alloc", "alloc_extend", "alloc_decode", "free", "free_segment", "free_pages", "tree_insert", "tree_unlock", "group_end"}


def _resolve(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _arg(args: tuple, kwargs: dict, name: str, pos: int) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else None


def _short_path(filename: str) -> str:
    """A call site's file as a reader finds it: from the package root, not the machine's layout."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    for package in ("/sglang/", "/vllm/", "/kvdoctor/", "/bench/", "/tests/"):
        if package in filename:
            return package[1:] + filename.rsplit(package, 1)[1]
    return os.path.basename(filename)


class _Local(threading.local):
    def __init__(self) -> None:
        self.busy: dict[int, int] = {}
        self.active: set[tuple[int, str]] = set()
        self.evicting = 0


_LOCAL = _Local()


class Probe:
    """One per process. Holds the emitter, the ledgers and the map in force."""

    def __init__(self, trace_path: str | None, *, fixes: list[str] | None = None, inject: set[str] | None = None) -> None:
        self.trace_path = trace_path
        self.fixes = list(fixes or [])
        self.inject = set(inject or ())
        self.emitter = Emitter(trace_path, header_args={"engine": "sglang", "engine_version": "", "probe": "kvdoctor"})
        self.sites = CallSites()
        self.requests = RequestTable()
        self.ledgers: dict[int, SlotLedger] = {}
        self.primary: SlotLedger | None = None
        self.ledger_on = True
        self.off_reason = ""
        self.map: ProbeMap | None = None
        self.maps: dict[str, ProbeMap | None] = {}
        self.version = ""
        self.patched: list[str] = []
        self.missing: list[str] = []
        self.calls = 0
        self.failures = 0
        self.census_pending = False
        self.last_loc_sources: dict[int, tuple[Any, ...]] = {}
        self.fix_counts: dict[str, int] = {}
        self._fix_unreported: dict[str, int] = {}
        self.extensions: list[Any] = []  # engine add-ons (HiCache) with a periodic() of their own
        self.tree: Any = None       # the radix tree last seen, for the census's evictable/protected sizes
        self.hicache: Any = None    # HiCache bookkeeping (kvdoctor.probe.sglang.hicache), once a HiCache class is met
        self.local = _LOCAL
        self._site_cache: dict[tuple, int] = {}
        # An idle census reads the whole ledger back: at most one per interval (and one at exit).
        self.idle_census_interval_s = float(os.environ.get("KVDOCTOR_IDLE_CENSUS_INTERVAL_S", "2.0"))
        self.last_idle_census = -1e9
        self._closed = False
        self.emitter.periodic.append(self._periodic)

    # ----- status -----

    def status(self, state: str, reason: str, **extra: Any) -> None:
        self.emitter.emit(schema.PROBE_STATUS, {"component": "ledger", "state": state, "reason": reason, **extra})

    def fixed(self, fix: str, count: int = 1, **evidence: Any) -> None:
        """A fix changed the host's behaviour: counted, and the first few occurrences described."""
        total = self.fix_counts.get(fix, 0)
        self.fix_counts[fix] = total + count
        if total < 16 and evidence:
            self.emitter.emit(schema.FIX_APPLIED, {"fix": fix, "count": count, **evidence})
        elif total < 16:
            self.emitter.emit(schema.FIX_APPLIED, {"fix": fix, "count": count})
        else:
            self._fix_unreported[fix] = self._fix_unreported.get(fix, 0) + count

    def fix_failed(self, role: str, exc: BaseException) -> None:
        """A fix that cannot apply is dropped; the host's call proceeds unfixed."""
        self.fixes = []
        self.status("partial", f"fixes turned off after {type(exc).__name__} in the {role} fix: {exc}")

    def fail(self, role: str, exc: BaseException) -> None:
        """Our own bug or a host we do not understand: stop feeding the ledger, say why."""
        self.failures += 1
        if not self.ledger_on:
            return
        self.ledger_on = False
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        at = f" at {_short_path(where[0].filename)}:{where[0].lineno}" if where else ""
        self.off_reason = f"{type(exc).__name__} in the {role} hook{at}: {exc}"
        self.status("off", self.off_reason + "; the server's calls go on untouched, ledger findings stop here")

    # ----- ledgers -----

    def ledger_for(self, allocator: Any) -> SlotLedger:
        ledger = self.ledgers.get(id(allocator))
        if ledger is not None:
            return ledger
        size = getattr(allocator, "size", None)
        page_size = getattr(allocator, "page_size", None)
        if not isinstance(size, int) or not isinstance(page_size, int) or size <= 0 or page_size <= 0:
            raise TypeError(f"{type(allocator).__name__} has no usable size/page_size ({size!r}, {page_size!r})")
        name = f"{type(allocator).__name__}#{len(self.ledgers)}"
        ledger = SlotLedger(
            name=name,
            size=size,
            page_size=page_size,
            device=getattr(allocator, "device", "cpu"),
            emit=self.emitter.emit,
            requests=self.requests,
            sites=self.sites,
        )
        self.ledgers[id(allocator)] = ledger
        ledger.host = allocator  # type: ignore[attr-defined]
        if self.primary is None:
            self.primary = ledger
        self.emitter.emit(
            schema.PROBE_STATUS,
            {"component": "ledger", "state": "on", "reason": f"ledger for {name}", "allocator": name,
             "size": size, "page_size": page_size, "device": str(getattr(allocator, "device", "cpu"))},
        )
        return ledger

    def site(self) -> int:
        frame = sys._getframe(2)
        caller = frame.f_back
        quick = (frame.f_code, frame.f_lineno, caller.f_code if caller else None, caller.f_lineno if caller else 0)
        found = self._site_cache.get(quick)
        if found is not None:
            return found
        found = self._site_slow(frame)
        if len(self._site_cache) < 65536:
            self._site_cache[quick] = found
        return found

    def _site_slow(self, frame: Any) -> int:
        frames = []
        while frame is not None and len(frames) < SITE_DEPTH:
            if "kvdoctor/probe" not in frame.f_code.co_filename:
                frames.append(frame)
            frame = frame.f_back
        key = tuple((f.f_code, f.f_lineno) for f in frames)

        def describe() -> str:
            return " < ".join(f"{f.f_code.co_name} ({_short_path(f.f_code.co_filename)}:{f.f_lineno})" for f in frames)

        return self.sites.intern(key, describe)

    # ----- census -----

    def census_all(self, reason: str) -> list[dict[str, Any]]:
        out = []
        if not self.ledger_on:
            return out
        for ledger in list(self.ledgers.values()):
            try:
                out.append(ledger.census(reason=reason, host_free_pages=_host_free_pages(ledger.host), tree_sizes=self._tree_sizes()))
            except Exception as exc:
                self.fail("census", exc)
        return out

    def _tree_sizes(self) -> dict[str, int]:
        tree = self.tree
        if tree is None:
            return {}
        try:
            return {"tree_evictable_slots": int(tree.evictable_size()), "tree_protected_slots": int(tree.protected_size())}
        except Exception:
            return {}

    def _periodic(self) -> None:
        for ledger in list(self.ledgers.values()):
            if not self.ledger_on:
                break
            try:
                ledger.poll()
                if ledger.xp.sync_free_branching:
                    self.emitter.counter(schema.LEDGER_COUNTER, ledger.counter_args())
                else:
                    counts = ledger.counter_args_async()
                    if counts is not None:
                        self.emitter.counter(schema.LEDGER_COUNTER, counts)
            except Exception as exc:
                self.fail("poll", exc)
        for fix, count in list(self._fix_unreported.items()):
            if count:
                self._fix_unreported[fix] = 0
                self.emitter.emit(schema.FIX_APPLIED, {"fix": fix, "count": count})
        for extension in list(self.extensions):
            try:
                extension.periodic(self)
            except Exception as exc:
                self.fail(type(extension).__name__, exc)
        self.emitter.counter(schema.PROBE_STATS, {"hooked_calls": self.calls, "probe_failures": self.failures, **self.emitter.stats()})

    def shutdown(self, reason: str = "exit") -> None:
        if self._closed:
            return
        self._closed = True
        if self.map is None and not self.ledgers and not self.emitter.buffer and not self.emitter.header_written:
            return  # this process never met an engine: it leaves no trace at all
        try:
            self._periodic()
            if self.ledgers:
                self.census_all(reason)
                for ledger in self.ledgers.values():
                    self.emitter.counter(schema.LEDGER_COUNTER, ledger.counter_args())
            self.emitter.counter(schema.PROBE_STATS, {"hooked_calls": self.calls, "probe_failures": self.failures, **self.emitter.stats()})
        except Exception as exc:
            self.fail("shutdown", exc)
        finally:
            self.emitter.close()

    # ----- patching -----

    def select_map(self, engine: str = "sglang") -> ProbeMap | None:
        """The map for the installed version of `engine`, or None (and the probe off) if unknown."""
        if engine in self.maps:
            return self.maps[engine]
        version = os.environ.get(ENV_FORCE_VERSION) if engine == "sglang" else None
        version = version or _engine_version(engine)
        probe_map = map_for(engine, version)
        if not self.emitter.header_args.get("engine_version"):
            self.emitter.header_args["engine"] = engine
            self.emitter.header_args["engine_version"] = version
        self.maps[engine] = probe_map
        if engine == "sglang":
            self.version = version
            self.map = probe_map
        if probe_map is None:
            self.ledger_on = False
            label = {"sglang": "SGLang", "vllm": "vLLM"}.get(engine, engine)
            self.off_reason = f"{label} {version or 'of unknown version'} is not a version kvdoctor knows (it knows {', '.join(known_versions(engine))})"
            self.status("off", self.off_reason + "; the probe stays out of this process and the server runs untouched")
            return None
        if probe_map.handlers_module:
            importlib.import_module(probe_map.handlers_module)  # registers that engine's roles
        return probe_map

    def patch_module(self, module: Any) -> None:
        name = module.__name__
        probe_map = self.select_map(name.split(".", 1)[0])
        if probe_map is None:
            return
        for hooks in probe_map.classes:
            if hooks.module != name:
                continue
            cls = getattr(module, hooks.cls, None)
            if cls is None:
                self.missing.append(f"{name}.{hooks.cls}")
                continue
            for method, role in hooks.methods.items():
                original = cls.__dict__.get(method)
                if original is None:
                    self.missing.append(f"{hooks.cls}.{method}")
                    continue
                if getattr(original, "__kvdoctor_role__", None):
                    continue
                setattr(cls, method, self._wrap(original, role, hooks))
                self.patched.append(f"{hooks.cls}.{method}")
        for fn_hook in probe_map.functions:
            if fn_hook.module != name:
                continue
            original = getattr(module, fn_hook.function, None)
            if original is None or getattr(original, "__kvdoctor_role__", None):
                if original is None:
                    self.missing.append(f"{name}.{fn_hook.function}")
                continue
            wrapped = self._wrap_function(original, fn_hook.role)
            setattr(module, fn_hook.function, wrapped)
            _rebind_imported(original, wrapped)
            self.patched.append(f"{name}.{fn_hook.function}")
        self.status(
            "on" if not self.missing else "partial",
            f"{ {'sglang': 'SGLang', 'vllm': 'vLLM'}.get(probe_map.engine, probe_map.engine)} {probe_map.versions[0]}: {len(self.patched)} methods hooked" + (f"; not found: {', '.join(self.missing)}" if self.missing else ""),
            map=probe_map.source,
        )

    def _wrap(self, original: Callable, role: str, hooks: ClassHooks) -> Callable:
        handler = HANDLERS[role]
        composite = role in COMPOSITE_ROLES
        wants_site = role in ROLES_WITH_SITE
        positions = hooks.args.get(original.__name__, {})
        local = _LOCAL
        has_finally = type(handler).finally_ is not Handler.finally_
        # A handler may turn one-shot arguments (iterators) into lists that yield the same items,
        # so that it and the host both see them.
        prepare = getattr(handler, "prepare_args", None)

        @functools.wraps(original)
        def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            probe = _PROBE
            if probe is None or not probe.ledger_on:
                return original(obj, *args, **kwargs)
            key = (id(obj), role)
            busy = local.busy
            if key in local.active or (composite and busy.get(id(obj))):
                return original(obj, *args, **kwargs)
            ctx = None
            ok = True
            try:
                probe.calls += 1
                if role in probe.inject:
                    raise RuntimeError(f"fault injected into the {role} hook")
                site = probe.site() if wants_site else 0
                if prepare is not None:
                    args, kwargs = prepare(args, kwargs)
                ctx = handler.before(probe, obj, args, kwargs, hooks, positions, site)
            except Exception as exc:
                ok = False
                probe.fail(role, exc)
            call_args, call_kwargs = args, kwargs
            if ok and probe.fixes:
                try:
                    call_args, call_kwargs = handler.rewrite(probe, obj, args, kwargs, hooks, positions, ctx)
                except Exception as exc:
                    call_args, call_kwargs = args, kwargs
                    probe.fix_failed(role, exc)
            local.active.add(key)
            if composite:
                busy[id(obj)] = busy.get(id(obj), 0) + 1
            try:
                result = original(obj, *call_args, **call_kwargs)
            finally:
                local.active.discard(key)
                if composite:
                    busy[id(obj)] -= 1
                if ok and has_finally:
                    try:
                        handler.finally_(probe, ctx)
                    except Exception as exc:
                        ok = False
                        probe.fail(role, exc)
            if ok and probe.ledger_on:
                try:
                    handler.after(probe, obj, args, kwargs, result, ctx, hooks, positions)
                except Exception as exc:
                    probe.fail(role, exc)
                if probe.fixes:
                    try:
                        result = handler.rewrite_result(probe, obj, result)
                    except Exception as exc:
                        probe.fix_failed(role, exc)
            return result

        wrapper.__kvdoctor_role__ = role  # type: ignore[attr-defined]
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_function(self, original: Callable, role: str) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            probe = _PROBE
            if probe is not None and probe.ledger_on and role == "last_loc_source":
                try:
                    req_to_token = _arg(args, kwargs, "req_to_token", 0)
                    req_indices = _arg(args, kwargs, "req_pool_indices_tensor", 1)
                    prefix_lens = _arg(args, kwargs, "prefix_lens_tensor", 2)
                    sources = probe.last_loc_sources
                    sources[id(result)] = (result, req_indices, req_to_token, prefix_lens)
                    if len(sources) > 64:
                        sources.pop(next(iter(sources)))
                except Exception as exc:
                    probe.fail(role, exc)
            return result

        wrapper.__kvdoctor_role__ = role  # type: ignore[attr-defined]
        return wrapper


def _host_free_pages(allocator: Any) -> Any:
    """The allocator's own free list (pages), for the census cross-check; None if unreadable."""
    try:
        getter = getattr(allocator, "get_all_free_pages", None)
        if getter is not None:
            pages = getter()
        else:
            parts = [getattr(allocator, "free_pages", None), getattr(allocator, "release_pages", None)]
            import torch

            pages = torch.cat([p for p in parts if p is not None and p.numel() > 0]) if any(
                p is not None and p.numel() > 0 for p in parts
            ) else None
        if pages is None:
            return []
        return pages.detach().cpu().numpy()
    except Exception:
        return None


def _rebind_imported(original: Callable, wrapped: Callable) -> None:
    """Modules that did `from x import f` before we patched x still hold the original."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace or not getattr(module, "__name__", "").startswith(("sglang", "vllm")):
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                try:
                    setattr(module, attr, wrapped)
                except Exception:
                    pass


def _engine_version(engine: str) -> str:
    if engine == "sglang":
        try:
            return str(importlib.import_module("sglang._version").__version__)
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


# ----- role handlers: before() runs ahead of the host's call, after() once it returned -----


class Handler:
    def before(self, probe, obj, args, kwargs, hooks, positions, site):  # noqa: ANN001
        return site

    def rewrite(self, probe, obj, args, kwargs, hooks, positions, ctx):  # noqa: ANN001
        """Only with an optional fix on: the arguments the host's method is called with."""
        return args, kwargs

    def rewrite_result(self, probe, obj, result):  # noqa: ANN001
        """Only with an optional fix on: what the host's caller receives."""
        return result

    def finally_(self, probe, ctx):  # noqa: ANN001
        return None

    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):  # noqa: ANN001
        return None


def _group_open(obj: Any, hooks: ClassHooks) -> bool:
    attr = hooks.options.get("group_attr")
    if not attr:
        return False
    value = getattr(obj, attr, None)
    if hooks.options.get("group_open_when") == "false":
        return value is False
    return value is not None


class AllocHandler(Handler):
    only_page_starts = False

    def prefix_lens(self, args, kwargs):  # noqa: ANN001
        return None

    def before(self, probe, obj, args, kwargs, hooks, positions, site):
        ledger = probe.ledger_for(obj)
        if probe.census_pending:
            probe.census_pending = False
            now = time.monotonic()
            if now - probe.last_idle_census >= probe.idle_census_interval_s:
                probe.last_idle_census = now
                probe.census_all("idle")
        pos = positions.get("last_loc")
        source = None
        if pos is not None:
            last_loc = _arg(args, kwargs, "last_loc", pos)
            if last_loc is not None:
                source = probe.last_loc_sources.get(id(last_loc))
                source = source if source is not None and source[0] is last_loc else None
                ledger.check_last_loc(last_loc, site, source[1] if source else None)
        return (ledger, site, source)

    def rewrite(self, probe, obj, args, kwargs, hooks, positions, ctx):
        pos = positions.get("last_loc")
        if pos is None or ctx is None:
            return args, kwargs
        last_loc = _arg(args, kwargs, "last_loc", pos)
        if last_loc is None:
            return args, kwargs
        ledger, site, source = ctx
        fixed = last_loc
        if "recompute-last-loc" in probe.fixes and source is not None and source[2] is not None:
            recomputed = fixes.recompute_last_loc(source[2], source[1], source[3], like=last_loc)
            _report_fix(probe, ledger, "recompute-last-loc", fixed, recomputed, site)
            fixed = recomputed
        if "clamp-last-loc" in probe.fixes:
            clamped = fixes.clamp_last_loc(fixed, ledger.rows, ledger.page_size, self.prefix_lens(args, kwargs))
            _report_fix(probe, ledger, "clamp-last-loc", fixed, clamped, site, moved_into_rows=[ledger.rows - ledger.page_size, ledger.rows - 1])
            fixed = clamped
        if fixed is last_loc:
            return args, kwargs
        if "last_loc" in kwargs:
            kwargs = {**kwargs, "last_loc": fixed}
        else:
            args = args[:pos] + (fixed,) + args[pos + 1 :]
        return args, kwargs

    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        if result is None or ctx is None:
            return
        ledger, site = ctx[0], ctx[1]
        with ledger.lock:
            ledger.on_alloc(result, site, only_page_starts=self.only_page_starts)


def _report_fix(probe: Probe, ledger: SlotLedger, name: str, before: Any, after: Any, site: int, **evidence: Any) -> None:
    """Counts what a last_loc fix changed. On the host the changed values are counted; on a GPU
    that would be a read-back, so the calls it applied to are counted instead, and said so."""
    if ledger.xp.sync_free_branching:
        changed = int((after != before).sum())
        if changed:
            probe.fixed(name, changed, site=probe.sites.name(site), allocator=ledger.name, **evidence)
    else:
        probe.fixed(name, 1, site=probe.sites.name(site), allocator=ledger.name, counted="calls (values are not read back on a GPU)", **evidence)


class ExtendHandler(AllocHandler):
    only_page_starts = True

    def prefix_lens(self, args, kwargs):  # noqa: ANN001
        """alloc_extend(prefix_lens, ...): the tokens before last_loc + 1."""
        return _arg(args, kwargs, "prefix_lens", 0)


class DecodeHandler(ExtendHandler):
    def prefix_lens(self, args, kwargs):  # noqa: ANN001
        """alloc_decode(seq_lens, ...): seq_lens counts the new token."""
        seq_lens = _arg(args, kwargs, "seq_lens", 0)
        return None if seq_lens is None else seq_lens - 1


class FreeHandler(Handler):
    as_pages = False

    def before(self, probe, obj, args, kwargs, hooks, positions, site):
        if _group_open(obj, hooks):
            return None  # staged in the group; recorded when the group ends
        return (probe.ledger_for(obj), site)

    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        if ctx is None:
            return
        ledger, site = ctx
        index = args[0] if args else next(iter(kwargs.values()), None)
        if index is None or not hasattr(index, "numel") or index.numel() == 0:
            return
        with ledger.lock:
            ledger.on_free(index, site, evicting=probe.local.evicting > 0, as_pages=self.as_pages)


    def rewrite(self, probe, obj, args, kwargs, hooks, positions, ctx):
        if "dedup-free" not in probe.fixes or ctx is None or not args:
            return args, kwargs
        ledger, site = ctx
        kept, dropped = fixes.drop_already_free(ledger, args[0], as_pages=self.as_pages)
        if dropped:
            probe.fixed("dedup-free", dropped, site=probe.sites.name(site), allocator=ledger.name)
            return (kept,) + args[1:], kwargs
        return args, kwargs


class FreePagesHandler(FreeHandler):
    as_pages = True


class GroupEndHandler(Handler):
    def before(self, probe, obj, args, kwargs, hooks, positions, site):
        attr = hooks.options.get("group_pages_attr")
        staged = list(getattr(obj, attr, None) or []) if attr else []
        return (probe.ledger_for(obj), site, staged)

    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        ledger, site, staged = ctx
        with ledger.lock:
            for pages in staged:
                if hasattr(pages, "numel") and pages.numel():
                    ledger.on_free(pages, site, evicting=probe.local.evicting > 0, as_pages=True)


class ClearHandler(Handler):
    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        ledger = probe.ledger_for(obj)
        with ledger.lock:
            ledger.reset_all_free()


class NoteHandler(Handler):
    """Roles that change no slot's owner (group begin, merge of staged pages, lock)."""


def _tree_ledger(probe: Probe, tree: Any) -> SlotLedger | None:
    allocator = getattr(tree, "token_to_kv_pool_allocator", None)
    if allocator is None:
        return None
    probe.tree = tree
    return probe.ledger_for(allocator)


def _tree_size(tree: Any) -> int:
    return int(tree.evictable_size()) + int(tree.protected_size())


class TreeInsertHandler(Handler):
    def before(self, probe, obj, args, kwargs, hooks, positions, site):
        ledger = _tree_ledger(probe, obj)
        if ledger is None:
            return None
        return (ledger, site, _tree_size(obj))

    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        if ctx is None:
            return
        ledger, site, size_before = ctx
        params = _arg(args, kwargs, "params", 0)
        value = getattr(params, "value", None)
        if value is None or not hasattr(value, "numel"):
            return
        grown = _tree_size(obj) - size_before
        prefix_len = getattr(result, "prefix_len", result if isinstance(result, int) else None)
        if grown <= 0 or not isinstance(prefix_len, int):
            return
        with ledger.lock:
            ledger.on_tree_insert(value[prefix_len : prefix_len + grown], site)


class TreeEvictHandler(Handler):
    def before(self, probe, obj, args, kwargs, hooks, positions, site):
        _tree_ledger(probe, obj)
        probe.local.evicting += 1
        return True

    def finally_(self, probe, ctx):
        if ctx:
            probe.local.evicting -= 1


class TreeUnlockHandler(Handler):
    def before(self, probe, obj, args, kwargs, hooks, positions, site):
        node = _arg(args, kwargs, "node", 0)
        lock_ref = getattr(node, "lock_ref", None)
        if isinstance(lock_ref, int) and lock_ref <= 0 and node is not getattr(obj, "root_node", None):
            probe.emitter.emit(
                schema.VIOLATION,
                {"kind": schema.LOCK_UNDERFLOW, "count": 1, "site": probe.sites.name(site),
                 "note": "dec_lock_ref on a node whose lock_ref is already 0: its slots become evictable while a request still uses them"},
            )
        return None


class TreeResetHandler(Handler):
    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        ledger = _tree_ledger(probe, obj)
        if ledger is not None:
            with ledger.lock:
                ledger.on_tree_reset()


class ReqAllocHandler(Handler):
    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        if not result:
            return
        reqs = _arg(args, kwargs, "reqs", 0)
        reqs = reqs if isinstance(reqs, (list, tuple)) else [None] * len(result)
        for req, index in zip(reqs, result):
            probe.requests.allocated(int(index), str(getattr(req, "rid", "?")))


class ReqFreeHandler(Handler):
    def before(self, probe, obj, args, kwargs, hooks, positions, site):
        req = _arg(args, kwargs, "req", 0)
        index = _resolve(req, hooks.options.get("req_index_attr", "req_pool_idx"))
        if index is None and isinstance(req, int):
            index = req
        return index

    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        if isinstance(ctx, int):
            probe.requests.freed(ctx)
        if probe.requests.idle:
            probe.census_pending = True


class ReqFreeRowsHandler(Handler):
    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        for index in _arg(args, kwargs, "indices", 0) or []:
            probe.requests.freed(int(index))
        if probe.requests.idle:
            probe.census_pending = True


class ReqWriteHandler(Handler):
    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        ledger = probe.primary
        if ledger is None:
            return
        indices = _arg(args, kwargs, "indices", 0)
        values = _arg(args, kwargs, "values", 1)
        if not isinstance(indices, tuple) or len(indices) != 2 or not hasattr(values, "numel"):
            return
        row = indices[0]
        if isinstance(row, int):
            owner: Any = row
        elif hasattr(row, "numel") and row.numel() == values.numel():
            owner = row
        else:
            return
        with ledger.lock:
            ledger.on_owner(values, owner)


class ReqClearHandler(Handler):
    def after(self, probe, obj, args, kwargs, result, ctx, hooks, positions):
        probe.requests.cleared()
        probe.census_pending = True


HANDLERS: dict[str, Handler] = {
    "alloc": AllocHandler(),
    "alloc_extend": ExtendHandler(),
    "alloc_decode": DecodeHandler(),
    "free": FreeHandler(),
    "free_segment": FreeHandler(),
    "free_pages": FreePagesHandler(),
    "group_begin": NoteHandler(),
    "group_end": GroupEndHandler(),
    "merge": NoteHandler(),
    "clear": ClearHandler(),
    "tree_insert": TreeInsertHandler(),
    "tree_evict": TreeEvictHandler(),
    "tree_lock": NoteHandler(),
    "tree_unlock": TreeUnlockHandler(),
    "tree_reset": TreeResetHandler(),
    "req_alloc": ReqAllocHandler(),
    "req_free": ReqFreeHandler(),
    "req_free_rows": ReqFreeRowsHandler(),
    "req_write": ReqWriteHandler(),
    "req_clear": ReqClearHandler(),
}


# ----- import hook -----


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, probe: Probe) -> None:
        self.inner = inner
        self.probe = probe

    def create_module(self, spec):  # noqa: ANN001
        return self.inner.create_module(spec)

    def exec_module(self, module):  # noqa: ANN001
        self.inner.exec_module(module)
        try:
            self.probe.patch_module(module)
        except Exception as exc:
            self.probe.fail("patch", exc)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, probe: Probe, modules: set[str]) -> None:
        self.probe = probe
        self.modules = modules

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001
        if fullname not in self.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self.probe)
                return spec
        return None


_PROBE: Probe | None = None


def current() -> Probe | None:
    return _PROBE


def activate(trace_path: str | None = None, *, fixes: list[str] | None = None) -> Probe | None:
    """Turns the probe on in this process (idempotent). Never raises."""
    global _PROBE
    if _PROBE is not None:
        return _PROBE
    try:
        if os.environ.get(ENV_DISABLE):
            return None
        trace_path = trace_path or os.environ.get(ENV_TRACE)
        if fixes is None:
            fixes = [f for f in os.environ.get(ENV_FIXES, "").split(",") if f]
        inject = {r for r in os.environ.get(ENV_INJECT, "").split(",") if r}
        probe = Probe(trace_path, fixes=fixes, inject=inject)
        modules = set()
        for probe_map in available_maps():
            modules |= probe_map.modules()
        finder = _Finder(probe, modules)
        sys.meta_path.insert(0, finder)
        _PROBE = probe
        for name in sorted(modules):
            module = sys.modules.get(name)
            if module is not None:
                probe.patch_module(module)
        try:
            from kvdoctor.probe import attribution

            attribution.start_if_enabled(probe)
        except Exception:
            pass
        atexit.register(probe.shutdown)
        try:
            from multiprocessing import util

            util.Finalize(None, probe.shutdown, exitpriority=100)
        except Exception:
            pass
        return probe
    except Exception:
        return None


def deactivate() -> None:
    """Ends the probe in this process (tests; `kvdoctor demo`). Patched methods become pass-throughs."""
    global _PROBE
    probe = _PROBE
    if probe is None:
        return
    probe.shutdown()
    probe.ledger_on = False
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    _PROBE = None
