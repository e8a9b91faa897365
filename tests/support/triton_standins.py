"""SGLang's Triton kernels that CPU runs of its GPU paths need, in torch, each doing what its source
does: one copy for every case script and test that stands them in (this machine has no GPU driver).

`Launch(body)` stands for the kernel object: `kernel[grid](*args)` runs `body(grid, *args)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Launch:
    """A Triton kernel's `kernel[grid](...)` launch, running `body(grid, *args)`."""

    def __init__(self, body: Callable[..., Any]) -> None:
        self.body = body

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.body(grid, *args, **kwargs)


def assign_req_to_token_pool(grid, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len, bs_upper):
    """`assign_req_to_token_pool[(batch_size,)]`: program `pid` copies the next `end - start` entries
    of `out_cache_loc` into `req_to_token[req_pool_indices[pid], start:end]`."""
    table, offset = req_to_token.view(-1), 0
    for pid in range(grid[0]):
        start, end, row = int(start_offset[pid]), int(end_offset[pid]), int(req_pool_indices[pid])
        if end > start:
            table[row * pool_len + start : row * pool_len + end] = out_cache_loc[offset : offset + end - start].to(table.dtype)
        offset += end - start
