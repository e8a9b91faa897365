"""Optional fixes: off by default, turned on by name (`kvdoctor run --fix NAME`, or at attach).

A fix changes what the host's method receives or returns. It never hides a finding: the ledger
still sees the host's original arguments, and every correction is counted in a `fix_applied`
event that names the fix, where it applied and how often.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Fix:
    name: str
    fixes: str
    changes: str
    risk: str


FIXES = {
    f.name: f
    for f in (
        Fix(
            "clone-host-indices",
            "sglang#19332: host memory grows without bound with HiCache L3 storage on (0.5.5-0.5.9)",
            "HostKVCache.alloc returns a copy of its indices instead of a view into free_slots, so a tree "
            "node storing them as host_value no longer keeps an old copy of the whole free list alive",
            "low: one small host-side copy of an index tensor per host allocation; nothing on the GPU",
        ),
        Fix(
            "dedup-free",
            "double frees: a second free of a slot puts it in the free list twice and it is later handed to two requests",
            "slots kvdoctor saw freed already are dropped from free()/free_page_ids() arguments (each reported)",
            "low on CPU indices; on GPU indices it is skipped (dropping entries needs a data-dependent shape, i.e. a sync)",
        ),
        Fix(
            "clamp-last-loc",
            "out-of-range last_loc reaching alloc_extend/alloc_decode (an illegal memory access on a GPU)",
            "last_loc values outside the KV buffer are moved into its last page, at the offset that continues the "
            "request's prefix (so the rest of that page, last_loc + 1 ..., stays inside too); -1 ('no prefix') is "
            "kept. Unlike clamp(0, total_slots) it never lets one-past-the-end through",
            "medium: the request's new tokens then continue a wrong page; it turns a crash into a wrong answer "
            "for one request, and every clamp is reported",
        ),
        Fix(
            "recompute-last-loc",
            "a stale last_loc: the request's last KV slot moved (a HiCache load, an eviction) between computing it and allocating after it",
            "last_loc is re-read from req_to_token right before alloc_extend/alloc_decode when kvdoctor saw how "
            "it was computed (get_last_loc); otherwise it is left alone",
            "low: one gather on the device, no synchronisation; it cannot help when the request's row itself is stale",
        ),
        Fix(
            "graph-guard",
            "a CUDA graph replayed while a HiCache host-to-device load for the batch is still copying",
            "before a graph runner's replay, the current stream waits on the finish events of in-flight HiCache "
            "loads (a device-side wait, no host synchronisation)",
            "low: the replay starts after the load finishes, which it had to anyway for correct results",
        ),
    )
}


def unknown(names: list[str]) -> list[str]:
    return [n for n in names if n not in FIXES]


def clamp_last_loc(last_loc: Any, rows: int, page_size: int = 1, prefix_lens: Any = None) -> Any:
    """-1 stays (no prefix); everything else is held inside [0, rows - 1]. With the prefix lengths of
    a paged allocator, an out-of-range value goes to the slot of the last page whose offset continues
    the prefix, so that the kernel's `last_loc + 1 + i` for the rest of that page stays inside too."""
    import torch

    if prefix_lens is None or page_size <= 1:
        return torch.where(last_loc == -1, last_loc, last_loc.clamp(0, rows - 1))
    inside = (last_loc >= 0) & (last_loc < rows)
    target = rows - page_size + (prefix_lens.to(device=last_loc.device, dtype=last_loc.dtype) - 1) % page_size
    return torch.where((last_loc == -1) | inside, last_loc, target)


def recompute_last_loc(req_to_token: Any, req_indices: Any, prefix_lens: Any, like: Any) -> Any:
    import torch

    rows = req_to_token[req_indices.long(), (prefix_lens - 1).clamp(min=0).long()].to(like.dtype)
    return torch.where(prefix_lens.to(like.device) > 0, rows, torch.full_like(like, -1))


def drop_already_free(ledger: Any, index: Any, *, as_pages: bool) -> tuple[Any, int]:
    """The free() argument without entries the ledger says are free already (host indices only)."""
    if not ledger.xp.sync_free_branching or not hasattr(index, "numel") or index.numel() == 0:
        return index, 0
    import numpy as np

    from kvdoctor.probe.base.vocabulary import FREE

    idx = ledger.xp.index(index)
    pages = idx if as_pages else idx // ledger.page_size
    inside = (pages >= 0) & (pages <= ledger.num_pages)
    free = np.zeros(idx.shape, dtype=bool)
    free[inside] = (ledger.state[pages[inside]] & FREE) != 0
    dropped = int(free.sum())
    if not dropped:
        return index, 0
    import torch

    return index[torch.from_numpy(~free)], dropped
