"""What the memory-class readings cost the process they run in (kvdoctor/probe/readings/memory_classes.py).

One reading is /proc/self/status (RssAnon), glibc's mallinfo2() and CPython's count of allocated
blocks. The last two walk what they count: mallinfo2 every free chunk in malloc's bins (under
each arena's lock), `sys.getallocatedblocks` every pool of the small-object allocator (holding
the GIL). So a reading is timed on three heaps of this process, one after the other:

* `fresh`: the interpreter and kvdoctor, nothing more;
* `python_heap`: plus `--python-objects` small Python objects kept alive (pools to walk);
* `fragmented_malloc`: plus `--free-chunks` free chunks of many sizes left in malloc's bins.

Each heap adds to the one before. For each: microseconds per reading (wall: median and 99th
percentile over `--readings`; and its CPU time, what the sampler holds against its 2 ms
budget), the same for each part alone, the fraction of one core the readings take at the
default 1 s period, and whether the sampler would turn itself off there (a reading over budget).

Prints one JSON object; `--out PATH` writes it there too.
Usage: python bench/bench_memory_classes.py [--readings 2000] [--python-objects 2000000] [--free-chunks 200000] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvdoctor.probe.readings import memory_classes

DEFAULT_PERIOD_S = memory_classes.DEFAULT_PERIOD_S


class _Emitter:
    """Where the sampler would emit; the bench only reads."""

    periodic: list[Callable[[], None]] = []


class _Probe:
    emitter = _Emitter()


def timed_us(call: Callable[[], Any], readings: int) -> dict[str, float]:
    """Median and 99th percentile of one call, in microseconds."""
    call()  # first call: lazy ctypes and import work is not a reading's cost
    samples = []
    for _ in range(readings):
        start = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    samples.sort()
    return {"median_us": round(statistics.median(samples), 1), "p99_us": round(samples[int(len(samples) * 0.99) - 1], 1)}


def measure(sampler: memory_classes.MemoryClassSampler, readings: int) -> dict[str, Any]:
    cpu_ns: list[int] = []

    def reading_and_its_cpu() -> None:
        sampler.read()
        cpu_ns.append(sampler.cost_ns["reading"])

    reading = timed_us(reading_and_its_cpu, readings)
    cpu_median_us = statistics.median(cpu_ns) / 1e3
    return {
        "reading": reading,
        "reading_cpu_median_us": round(cpu_median_us, 1),
        "parts": {
            "proc_self_status": timed_us(memory_classes.read_rss_bytes, readings),
            "mallinfo2": timed_us(sampler.mallinfo2, readings),
            "getallocatedblocks": timed_us(sys.getallocatedblocks, readings),
        },
        "percent_of_one_core_at_1s": round(cpu_median_us / (DEFAULT_PERIOD_S * 1e6) * 100, 4),
        # the sampler's own verdict: a reading over its CPU budget is the last one
        "over_budget": cpu_median_us * 1e3 > sampler.budget_ns,
        "budget_ms": sampler.budget_ns / 1e6,
        "readings_timed": readings,
        "python_blocks": sys.getallocatedblocks(),
        "malloc_free_chunks": int(sampler.mallinfo2().ordblks),
    }


def fragment_malloc(chunks: int) -> list[int]:
    """Leaves about `chunks` free chunks of varied sizes in malloc's bins: every other block of a
    run is freed, so its neighbours keep the holes from merging. Returns the blocks kept."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(200 + (i % 64) * 24) for i in range(2 * chunks)]  # above tcache's and the fastbins' sizes
    for address in blocks[::2]:
        libc.free(address)
    return blocks[1::2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readings", type=int, default=2000)
    parser.add_argument("--python-objects", type=int, default=2_000_000)
    parser.add_argument("--free-chunks", type=int, default=200_000)
    parser.add_argument("--out")
    args = parser.parse_args()
    probe = _Probe()  # held: the sampler holds its probe weakly
    sampler = memory_classes.MemoryClassSampler(probe)
    report: dict[str, Any] = {"period_s": DEFAULT_PERIOD_S, "readings": args.readings}
    report["fresh"] = measure(sampler, args.readings)
    kept = [(i, str(i)) for i in range(args.python_objects)]
    report["python_heap"] = measure(sampler, args.readings)
    report["python_heap"]["python_objects"] = args.python_objects
    held = fragment_malloc(args.free_chunks)
    report["fragmented_malloc"] = measure(sampler, max(20, args.readings // 50))  # each reading takes tens of ms here
    report["fragmented_malloc"]["free_chunks_made"] = args.free_chunks
    del kept, held
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
