"""The demo end to end: a fresh trace, the probe on in this process, SGLang's real allocator and
radix tree under the chat workload with a planted fault, and the analysis of what was recorded.
No GPU, no model, no download."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.delivery.launch import start_trace
from kvdoctor.demo.workload import FAULTS, WorkloadConfig
from kvdoctor.errors import KvdoctorError
from kvdoctor.runner import analyze_recorded, default_trace_path
from kvdoctor.trace import schema
from kvdoctor.trace.writer import finish_trace

# The finding each planted fault must produce for the demo to count as diagnosed.
EXPECTED_KIND = {
    "leak": schema.ORPHAN_SLOTS,
    "double-free": schema.DOUBLE_FREE,
    "stale-last-loc": schema.STALE_LAST_LOC,
    "relocate": schema.STALE_LAST_LOC,
    "index-out-of-range": schema.INDEX_OUT_OF_RANGE,
    "double-alloc": schema.DOUBLE_ALLOC,
    "row-leak": schema.REQUEST_ROWS_LEAKED,
}
# SGLang passes last_loc only to the paged allocator, so these faults need pages of several slots.
PAGED_FAULTS = ("stale-last-loc", "relocate")
PAGED_DEFAULT_PAGE_SIZE = 4


@dataclasses.dataclass
class DemoRun:
    fault: str
    page_size: int
    trace_path: str
    engine_version: str
    requests: int
    evictions: int
    sglang_check: dict[str, Any]
    analysis: Analysis

    @property
    def diagnosed(self) -> bool:
        """Whether the planted fault was found (a clean run has nothing to find)."""
        wanted = EXPECTED_KIND.get(self.fault)
        return wanted is None or any(f.kind == wanted for f in self.analysis.findings)

    def workload_lines(self) -> list[str]:
        """What was run, and what SGLang's own idle check would have said about it."""
        allocator = "PagedTokenToKVPoolAllocator" if self.page_size > 1 else "TokenToKVPoolAllocator"
        lines = [
            f"workload: {self.requests} requests in multi-turn chats through SGLang {self.engine_version}'s real "
            f"{allocator} (page_size {self.page_size}) and RadixCache; {self.evictions} evictions; planted fault: {self.fault}"
        ]
        check = self.sglang_check
        if check.get("diff"):
            lines.append(
                f"SGLang's own idle check would only say: token_to_kv_pool_allocator memory leak detected! "
                f"available={check['available']}, evictable={check['evictable']}, protected={check['protected']}, diff={check['diff']}"
            )
        return lines


def demo_page_size(fault: str, page_size: int | None) -> int:
    """The page size to run `fault` with, or a one-line refusal of the combination."""
    if fault not in FAULTS:
        raise KvdoctorError(f"unknown fault {fault!r}", f"choose one of {', '.join(FAULTS)}")
    if page_size is None:
        return PAGED_DEFAULT_PAGE_SIZE if fault in PAGED_FAULTS else 1
    if page_size < 1:
        raise KvdoctorError(f"--page-size must be 1 or more, not {page_size}")
    if fault in PAGED_FAULTS and page_size == 1:
        raise KvdoctorError(f"{fault} needs --page-size > 1", "SGLang passes last_loc only to the paged allocator")
    return page_size


def run_demo(fault: str, page_size: int | None = None, trace_path: str | None = None, *, force: bool = False) -> DemoRun:
    page_size = demo_page_size(fault, page_size)
    warnings.filterwarnings("ignore")
    from kvdoctor.probe.core import runtime

    trace_path = os.path.abspath(trace_path or default_trace_path("demo"))
    start_trace(trace_path, ["kvdoctor", "demo", "--fault", fault], {"fault": fault, "page_size": page_size}, force=force)
    probe = runtime.activate(trace_path)
    if probe is None:
        raise KvdoctorError("the probe could not start in this process")
    try:
        from kvdoctor.demo.workload import run_workload
    except ImportError as exc:
        raise KvdoctorError(f"SGLang is not importable here ({exc})", "run the README's first command to create .venv") from None
    result = run_workload(WorkloadConfig(fault=fault, page_size=page_size))
    runtime.deactivate()
    finish_trace(trace_path, os.getpid())
    return DemoRun(
        fault=fault,
        page_size=page_size,
        trace_path=trace_path,
        engine_version=probe.version_of("sglang"),
        requests=result.requests,
        evictions=result.evictions,
        sglang_check=dict(result.sglang_check),
        analysis=analyze_recorded(trace_path),
    )
