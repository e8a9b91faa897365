"""Which rank of a parallel engine this process is, for the names of its ledgers.

With tensor, data or pipeline parallelism every rank is a process with its own pools: without the
rank, two ranks' ledgers read as one (`TokenToKVPoolAllocator#0` in each). Both engines put the rank
in the process title they set before building any pool (SGLang `sglang::scheduler_DP0_TP1`, vLLM
`VLLM::EngineCore_DP1`); the title is what the kernel shows in /proc/self/cmdline.
"""

from __future__ import annotations

import re

_RANK = re.compile(r"(?<![A-Za-z])(DP|TP|PP|EP)(\d+)(?![A-Za-z])")


def rank_of(title: str) -> str:
    """'tp1', 'dp0/tp1', ... from a process title; '' when it names no rank."""
    head = title.split("\0", 1)[0].split(" ", 1)[0]
    if "::" not in head:
        return ""
    return "/".join(f"{kind.lower()}{number}" for kind, number in _RANK.findall(head.split("::", 1)[1]))


def this_rank() -> str:
    """This process's rank, read from its title now; '' when it has none or it cannot be read."""
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            return rank_of(fh.read(4096).decode("utf-8", "replace"))
    except OSError:
        return ""


def ledger_name(kind: str, number: int, part: str = "") -> str:
    """A ledger's name: the pool's class and its number in the process, after the rank and the
    part the pool plays in a composite ('full', 'swa'), if any: `tp1/swa/TokenToKVPoolAllocator#1`."""
    prefix = "/".join(p for p in (this_rank(), part) if p)
    return f"{prefix}/{kind}#{number}" if prefix else f"{kind}#{number}"
