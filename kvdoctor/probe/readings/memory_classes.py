"""The process's anonymous memory split by who holds it, read from inside the process.

From outside, /proc says only that anonymous memory grows. Inside, a few readings tell the
classes apart (about 18 µs in all on a young heap; none touches the GPU):

* the Python heap: tracemalloc's traced total when tracemalloc has run since the interpreter
  started (PYTHONTRACEMALLOC, -X tracemalloc), and always the interpreter's count of allocated
  blocks (`sys.getallocatedblocks`), a count of live Python allocations, not bytes;
* the malloc heap: glibc's `mallinfo2()`, bytes in use (`uordblks + hblkhd`). torch's CPU
  allocator has no statistics of its own; CPU tensors are malloc'd, so they are counted here,
  with every C/C++ extension's malloc (`malloc_heap_bytes` leaves out tracemalloc's own
  bookkeeping, which is malloc'd too and grows with what it traces);
* torch's pinned host cache, where this process already initialised CUDA:
  `torch.cuda.memory.host_memory_stats()`, bytes owned by the cache and bytes handed out (cached
  blocks that are never reused pile up, vllm#48165). cudaHostAlloc memory is a shared /dev/zero
  mapping, so it is not part of anonymous memory and is not subtracted from it;
* native, unexplained: RssAnon minus the malloc heap in use minus the Python heap in bytes (when
  known). What is left: memory a native library maps for itself (its own mmap, another
  allocator), thread stacks, and, without tracemalloc, CPython's small-object arenas, which is
  why its growth is blamed on native code only while the Python blocks stay flat. Large Python
  objects are malloc'd, so with tracemalloc they are subtracted twice: this class then errs low,
  never blaming native code for Python's growth.

A daemon thread takes one reading every `KVDOCTOR_MEMORY_CLASSES_PERIOD_S` (1 s) and emits it as
a `memory_classes` counter; it never runs on the engine's threads, holds nothing that grows, and
stops when the probe turns off or its trace closes. It emits only once the probe writes a trace
in this process (it met an engine, or attribution is on), so processes that merely looked for an
engine stay traceless, unless `KVDOCTOR_MEMORY_CLASSES=1` asks for readings from activation; `0`
turns it off. Anything not understood (no mallinfo2 outside glibc 2.33+, a malloc that is not
glibc's such as a preloaded jemalloc or tcmalloc, no /proc) turns it off with one `probe_status`
line (component "memory_classes"); a pinned-cache reading that fails turns off that class alone.
Two readings walk what they count (mallinfo2 every free chunk in malloc's bins under malloc's
locks, the block count every pool of CPython's allocator under the GIL): each reading's CPU time
is measured, and the first one over `KVDOCTOR_MEMORY_CLASSES_BUDGET_MS` (2 ms) turns the
readings off too, naming the part that took it, so a fragmented heap costs one slow reading.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import tracemalloc
import weakref
from typing import Any

from kvdoctor.probe.base.settings import env_positive, env_switch, env_text
from kvdoctor.trace import schema

ENV_MEMORY_CLASSES = "KVDOCTOR_MEMORY_CLASSES"
ENV_PERIOD_S = "KVDOCTOR_MEMORY_CLASSES_PERIOD_S"
ENV_BUDGET_MS = "KVDOCTOR_MEMORY_CLASSES_BUDGET_MS"
DEFAULT_PERIOD_S = 1.0
MIN_PERIOD_S = 0.01
# The CPU time one reading may take. mallinfo2 walks every free chunk in malloc's bins holding
# each arena's lock, and CPython's block count walks every pool holding the GIL: on a fragmented
# heap a reading can stall the engine's threads for tens of milliseconds (bench/bench_memory_classes.py),
# so the first reading over this budget is the last one.
DEFAULT_BUDGET_MS = 2.0
COMPONENT = "memory_classes"
PYTHON_SOURCE_TRACEMALLOC = "tracemalloc"
PYTHON_SOURCE_BLOCKS = "allocated_blocks"

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
# One entry per probe: its sampler, or None once starting failed (said once, never retried).
_STARTED: weakref.WeakKeyDictionary[Any, MemoryClassSampler | None] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class Mallinfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): the same fields as mallinfo, as size_t."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


class NotUnderstood(Exception):
    """This process offers no reading the split needs: the sampler turns off and says why."""


def start_if_enabled(probe: Any) -> bool:
    """Starts the readings for `probe` unless KVDOCTOR_MEMORY_CLASSES=0. Idempotent; never raises."""
    try:
        if env_switch(ENV_MEMORY_CLASSES, True) is False or getattr(probe, "emitter", None) is None:
            return False
        with _LOCK:
            if probe in _STARTED:
                return _STARTED[probe] is not None
            _STARTED[probe] = None
            sampler = MemoryClassSampler(probe)
            _STARTED[probe] = sampler
        sampler.start()
        return True
    except NotUnderstood as exc:
        _status(probe, "off", f"{exc}; memory classes are not read in this process")
        return False
    except Exception as exc:
        _status(probe, "off", f"{type(exc).__name__}: {exc}; memory classes are not read in this process")
        return False


def _status(probe: Any, state: str, reason: str, **extra: Any) -> None:
    try:
        probe.emitter.emit(schema.PROBE_STATUS, {"component": COMPONENT, "state": state, "reason": reason, **extra})
    except Exception:
        pass


def _period_s() -> float:
    return max(env_positive(ENV_PERIOD_S, DEFAULT_PERIOD_S), MIN_PERIOD_S)


def _budget_ns() -> int:
    return int(env_positive(ENV_BUDGET_MS, DEFAULT_BUDGET_MS, high=60_000.0) * 1e6)


SEEN_BYTES = 1 << 20  # one allocation that glibc's statistics must see if glibc's malloc made it
SEEN_TRIES = 3  # other threads allocate and free meanwhile: a few tries before concluding


def _in_use(info: Any) -> int:
    return int(info.uordblks) + int(info.hblkhd)


def glibc_serves_malloc(process: ctypes.CDLL, mallinfo2: Any) -> bool:
    """Whether the malloc this process calls is glibc's, asked of the heap itself: one block from
    it (never touched, so never resident) must show in mallinfo2. Comparing symbol addresses
    would not do: a non-PIE Python's own PLT entry is what `malloc` resolves to there."""
    malloc, free = process.malloc, process.free
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    for _ in range(SEEN_TRIES):
        before = _in_use(mallinfo2())
        block = malloc(SEEN_BYTES)
        if not block:
            return False
        seen = _in_use(mallinfo2()) - before >= SEEN_BYTES
        free(block)
        if seen:
            return True
    return False


def read_mallinfo2() -> Any:
    """glibc's mallinfo2 as a ctypes function; NotUnderstood where the C library has none, or
    where the process's malloc is not glibc's (a preloaded jemalloc or tcmalloc): glibc's
    statistics would then miss the whole heap and call it native, unexplained."""
    try:
        process = ctypes.CDLL(None)
        glibc = ctypes.CDLL("libc.so.6")
    except OSError as exc:
        raise NotUnderstood(f"glibc cannot be opened ({exc})") from exc
    function = getattr(glibc, "mallinfo2", None)
    if function is None:
        raise NotUnderstood("this C library has no mallinfo2() (glibc 2.33 or later), so the malloc heap cannot be told apart")
    function.argtypes = []
    function.restype = Mallinfo2
    if not glibc_serves_malloc(process, function):
        raise NotUnderstood(
            "malloc is not glibc's (an allocator such as jemalloc or tcmalloc is preloaded), so mallinfo2() does not see the heap"
        )
    return function


def read_rss_bytes() -> tuple[int, int]:
    """RssAnon and RssShmem of this process, from /proc/self/status."""
    try:
        with open("/proc/self/status", "rb") as fh:
            text = fh.read().decode("ascii", "replace")
    except OSError as exc:
        raise NotUnderstood(f"/proc/self/status cannot be read ({exc})") from exc
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssShmem"):
            parts = rest.split()
            if parts and parts[0].isdigit():
                found[key] = int(parts[0]) * 1024
    if "RssAnon" not in found:
        raise NotUnderstood("/proc/self/status has no RssAnon line (Linux 4.5 or later)")
    return found["RssAnon"], found.get("RssShmem", 0)


def tracemalloc_from_start() -> bool:
    """Whether tracemalloc was asked for at interpreter start, so its total is the whole heap
    (a window opened later, e.g. by attribution, sees only what was allocated since)."""
    return bool(os.environ.get("PYTHONTRACEMALLOC")) or "tracemalloc" in getattr(sys, "_xoptions", {})


def read_pinned_cache() -> dict[str, int] | None:
    """torch's pinned host cache, only where this process already initialised CUDA (the
    reading never initialises it, never imports torch, never synchronises with the device)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    if cuda is None or not cuda.is_initialized():
        return None
    stats_of = getattr(getattr(cuda, "memory", None), "host_memory_stats", None)
    if stats_of is None:
        return None
    stats = stats_of()
    return {
        "pinned_cache_bytes": int(stats.get("allocated_bytes.current", 0)),
        "pinned_active_bytes": int(stats.get("active_bytes.current", 0)),
        "pinned_cache_blocks": int(stats.get("allocations.current", 0)),
        "pinned_active_blocks": int(stats.get("active_requests.current", 0)),
    }


class MemoryClassSampler:
    """One per probe: a daemon thread that reads the memory classes every `period_s`. It holds its
    probe weakly: a probe that is gone (ended and dropped) ends its readings, and is not kept."""

    def __init__(self, probe: Any) -> None:
        self._probe = weakref.ref(probe)
        self.period_s = _period_s()
        self.budget_ns = _budget_ns()
        self.cost_ns: dict[str, int] = {}  # the last reading's CPU time: its costly parts and the whole
        self.forced = env_text(ENV_MEMORY_CLASSES).lower() in _ON
        self.from_start = tracemalloc_from_start()
        self.mallinfo2 = read_mallinfo2()
        self.pinned_on = True
        self.readings = 0
        self.thread: threading.Thread | None = None
        self.thread_pid = 0
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()
        self.off_reason = ""
        emitter = getattr(probe, "emitter", None)
        periodic = getattr(emitter, "periodic", None)
        if isinstance(periodic, list):
            periodic.append(self.ensure_running)  # a forked child restarts the thread from its writer

    @property
    def probe(self) -> Any:
        return self._probe()

    def start(self) -> None:
        self.ensure_running()

    def ensure_running(self) -> None:
        """Starts the thread in this process unless it already runs here (threads do not survive
        fork), or it stopped for good. Runs at activation and on the emitter's writer thread, so
        it starts one thread under a lock, never waiting for it (a lock a forked child inherits
        held is replaced); never raises."""
        try:
            if self.off_reason or self._probe_ended():
                return
            pid = os.getpid()
            if self._lock_pid != pid:
                self._lock, self._lock_pid = threading.Lock(), pid
            if not self._lock.acquire(blocking=False):
                return  # another caller is starting it
            try:
                if self.thread is not None and self.thread_pid == pid and self.thread.is_alive():
                    return
                self.thread_pid = pid
                self.thread = threading.Thread(target=self._run, name="kvdoctor-memory-classes", daemon=True)
                self.thread.start()
            finally:
                self._lock.release()
        except Exception:
            pass

    def _probe_ended(self) -> bool:
        probe = self.probe
        if probe is None:
            return True
        return not getattr(probe, "ledger_on", True) or bool(getattr(getattr(probe, "emitter", None), "closing", False))

    def _recording(self) -> bool:
        """The probe writes a trace in this process: it met an engine or emitted something."""
        if self.forced:
            return True
        emitter = getattr(self.probe, "emitter", None)
        return (
            bool(getattr(self.probe, "maps", None))
            or bool(getattr(emitter, "header_written", False))
            or bool(getattr(emitter, "buffer", None))
        )

    def _run(self) -> None:
        """The thread: a reading per period while the probe records; the first failure turns the
        readings off for good, said once. Nothing escapes into the host."""
        try:
            pid = os.getpid()
            while os.getpid() == pid and not self.off_reason and not self._probe_ended():
                began = time.monotonic()
                if self._recording():
                    try:
                        args = self.read()
                    except NotUnderstood as exc:
                        self.turn_off(str(exc))
                        return
                    except Exception as exc:
                        self.turn_off(f"{type(exc).__name__}: {exc}")
                        return
                    probe = self.probe
                    if probe is None:
                        return
                    probe.emitter.counter(schema.MEMORY_CLASSES, args)
                    del probe
                    if self.cost_ns["reading"] > self.budget_ns:
                        self.turn_off(self.too_costly(args), cause=schema.OFF_FOR_COST)
                        return
                time.sleep(max(0.0, self.period_s - (time.monotonic() - began)))
        except Exception as exc:  # the emitter failed, or the interpreter is ending
            self.turn_off(f"{type(exc).__name__}: {exc}")

    def turn_off(self, reason: str, cause: str = "") -> None:
        """Stops the readings in this process for good, said once; never raises. `cause`
        OFF_FOR_COST: the host is fine, reading it costs more than it may (said as information)."""
        try:
            if self.off_reason:
                return
            self.off_reason = reason or "stopped"
            extra = {"cause": cause} if cause else {}
            _status(self.probe, "off", f"{self.off_reason}; memory classes are not read in this process", **extra)
        except Exception:
            pass

    def too_costly(self, args: dict[str, Any]) -> str:
        cost = {name: f"{ns / 1e6:.1f} ms" for name, ns in self.cost_ns.items()}
        return (
            f"one reading took {cost['reading']} of CPU, over the {self.budget_ns / 1e6:g} ms a reading may take "
            f"(mallinfo2 {cost['mallinfo2']}: it walks {args.get('malloc_free_chunks', 0):,} free malloc chunks holding "
            f"malloc's locks; the Python block count {cost['python_blocks']}: it walks the pools of "
            f"{args.get('python_blocks', 0):,} blocks holding the GIL)"
        )

    def read(self) -> dict[str, Any]:
        """One reading, in bytes (and Python's block count); raises NotUnderstood when it cannot.
        Its CPU time, whole and of the two parts that walk a heap, is left in `cost_ns`."""
        clock = time.thread_time_ns
        began = clock()
        anon, shmem = read_rss_bytes()
        before_malloc = clock()
        info = self.mallinfo2()
        before_blocks = clock()
        python_blocks = sys.getallocatedblocks()
        after_blocks = clock()
        malloc_in_use = int(info.uordblks) + int(info.hblkhd)
        args: dict[str, Any] = {
            "anon_bytes": anon,
            "shmem_bytes": shmem,
            "malloc_in_use_bytes": malloc_in_use,
            "malloc_free_bytes": int(info.fordblks),
            "malloc_free_chunks": int(info.ordblks),
            "malloc_mmapped_bytes": int(info.hblkhd),
            "python_blocks": python_blocks,
        }
        python_bytes = 0
        overhead = tracemalloc.get_tracemalloc_memory() if tracemalloc.is_tracing() else 0
        args["malloc_heap_bytes"] = malloc_in_use - overhead  # tracemalloc's own traces are malloc'd
        if self.from_start and tracemalloc.is_tracing():
            python_bytes = int(tracemalloc.get_traced_memory()[0])
            args["python_heap_bytes"] = python_bytes
            args["python_heap_source"] = PYTHON_SOURCE_TRACEMALLOC
            args["tracemalloc_overhead_bytes"] = overhead
        else:
            args["python_heap_source"] = PYTHON_SOURCE_BLOCKS
        args["native_unexplained_bytes"] = anon - malloc_in_use - python_bytes
        if self.pinned_on:
            try:
                pinned = read_pinned_cache()
            except Exception as exc:
                self.pinned_on = False
                _status(
                    self.probe,
                    "partial",
                    f"memory classes: torch's pinned host cache is not read ({type(exc).__name__}: {exc}); the other classes still are",
                )
                pinned = None
            if pinned is not None:
                args.update(pinned)
        self.readings += 1
        self.cost_ns = {
            "reading": clock() - began,
            "mallinfo2": before_blocks - before_malloc,
            "python_blocks": after_blocks - before_blocks,
        }
        return args
