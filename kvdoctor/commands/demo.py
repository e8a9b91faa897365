"""`kvdoctor demo`: SGLang's real allocator and radix tree, a multi-turn chat workload, a planted
fault, and the diagnosis a user would get. No GPU, no model, no download."""

from __future__ import annotations

import os
import sys
import warnings

from kvdoctor.errors import KvdoctorError
from kvdoctor.demo.workload import FAULTS, WorkloadConfig

EXPECTED_KIND = {
    "leak": "orphan_slots",
    "double-free": "double_free",
    "stale-last-loc": "stale_last_loc",
    "relocate": "stale_last_loc",
    "index-out-of-range": "index_out_of_range",
    "double-alloc": "double_alloc",
}


def run_demo(fault: str, page_size: int | None, trace_path: str | None, output_format: str) -> int:
    if fault not in FAULTS:
        raise KvdoctorError(f"unknown fault {fault!r}", f"choose one of {', '.join(FAULTS)}")
    if page_size is None:
        page_size = 4 if fault in ("stale-last-loc", "relocate") else 1
    if fault in ("stale-last-loc", "relocate") and page_size == 1:
        raise KvdoctorError(f"{fault} needs --page-size > 1", "SGLang passes last_loc only to the paged allocator")
    warnings.filterwarnings("ignore")
    from kvdoctor.commands.run import default_trace_path, start_trace
    from kvdoctor.probe import runtime

    trace_path = os.path.abspath(trace_path or default_trace_path("kvdoctor-demo"))
    start_trace(trace_path, ["kvdoctor", "demo", "--fault", fault], {"fault": fault, "page_size": page_size})
    probe = runtime.activate(trace_path)
    if probe is None:
        raise KvdoctorError("the probe could not start in this process")
    try:
        from kvdoctor.demo.workload import run_workload
    except ImportError as exc:
        raise KvdoctorError(f"SGLang is not importable here ({exc})", "run the README's first command to create .venv") from None
    result = run_workload(WorkloadConfig(fault=fault, page_size=page_size))
    runtime.deactivate()
    from kvdoctor.analysis.analyzer import exit_code_for
    from kvdoctor.runner import analyze_recorded as analyze_trace
    from kvdoctor.reporters import render
    from kvdoctor.trace.writer import finish_trace

    finish_trace(trace_path, os.getpid())
    analysis = analyze_trace(trace_path)
    check = result.sglang_check
    if output_format == "json":
        print(render(analysis, "json"))
    else:
        print(f"workload: {result.requests} requests in multi-turn chats through SGLang {probe.version}'s real "
              f"{'PagedTokenToKVPoolAllocator' if page_size > 1 else 'TokenToKVPoolAllocator'} (page_size {page_size}) "
              f"and RadixCache; {result.evictions} evictions; planted fault: {fault}")
        if check.get("diff"):
            print(f"SGLang's own idle check would only say: token_to_kv_pool_allocator memory leak detected! "
                  f"available={check['available']}, evictable={check['evictable']}, protected={check['protected']}, diff={check['diff']}")
        print(render(analysis, "text"))
        print(f"trace: {trace_path} (open it in Perfetto, or: kvdoctor replay {os.path.relpath(trace_path)})")
    if fault == "none":
        return exit_code_for(analysis)
    wanted = EXPECTED_KIND[fault]
    found = [f for f in analysis.findings if f.kind == wanted]
    if not found:
        print(f"kvdoctor: the planted {fault} was not diagnosed", file=sys.stderr)
        return 1
    return 0
