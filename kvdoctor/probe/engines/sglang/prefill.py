"""A prefill batch's request rows, written by `write_cache_indices` rather than `ReqToTokenPool.write`.

SGLang writes every prefill (extend) batch's rows through one function, `write_cache_indices`
(0.5.3.post2 - 0.5.15 in mem_cache/common.py, from 0.5.16 in mem_cache/allocation.py). Where the
attention backend supports Triton, as on any GPU server, it launches the kernel
`write_req_to_token_pool_triton` and calls no pool method: without this role every slot a live
request took at its prefill would look allocated and never written, an orphan to the rolling
census. Elsewhere (SGLang's CPU engine, the torch_native and ascend backends) it calls the hooked
`ReqToTokenPool.write` twice per request, and this role applies the same ownership once more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdoctor.probe.base import objects
from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.engines.sglang.speculative import ledger_of_rows, note_row_ends, written_spans
from kvdoctor.probe.engines.sglang.state import sglang_state

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


class ReqWriteExtendRole(Role):
    """`write_cache_indices(out_cache_loc, req_pool_indices_tensor, req_pool_indices_cpu,
    prefix_lens_tensor, prefix_lens_cpu, seq_lens_tensor, seq_lens_cpu, extend_lens_tensor,
    extend_lens_cpu, prefix_tensors, req_to_token_pool)`: request `i` gets `prefix_tensors[i]` at
    `req_to_token[req_pool_indices[i], :prefix_lens[i]]` and the next `seq_lens[i] -
    prefix_lens[i]` entries of `out_cache_loc` after it. Each slot's row is worked out on the
    tensors' device (`written_spans`); the host's `prefix_lens_cpu` says which prefix tensors to
    join, so no value is read back from a GPU.

    After every call, whichever branch SGLang took, the rows' ownership is applied. On the branch
    that calls `ReqToTokenPool.write` that is a second time: `SlotLedger.on_owner` only sets the
    owner of pages a request holds, raises nothing and changes no count, so the same (slot, row)
    twice leaves the ledger as once, and a free or tree-held slot is left as it was. Skipping it
    when the inner writes were seen would need a signal that they were: the probe's call count also
    grows with other threads' hooked calls, so a Triton call could be taken for a fallback one and
    its rows lost, each of their slots then a false orphan. A duplicate costs one vectorised call
    per prefill batch, beside the fallback's own per-request `.item()` reads; a lost write costs a
    false verdict."""

    ledger = "slots"
    reads = {
        "out_cache_loc": 0,
        "req_pool_indices_tensor": 1,
        "prefix_lens_tensor": 3,
        "prefix_lens_cpu": 4,
        "seq_lens_tensor": 5,
        "prefix_tensors": 9,
        "req_to_token_pool": 10,
    }

    def after(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, result: Any, ctx: Any) -> None:
        state = sglang_state(probe)
        table = objects.own(hook.arg(args, kwargs, "req_to_token_pool"), "req_to_token")
        ledger = ledger_of_rows(state, table) if table is not None else None
        values, rows, prefix_lens, seq_lens = (
            hook.arg(args, kwargs, n) for n in ("out_cache_loc", "req_pool_indices_tensor", "prefix_lens_tensor", "seq_lens_tensor")
        )
        if ledger is None or not all(hasattr(t, "numel") for t in (values, rows, prefix_lens, seq_lens)):
            return
        batch_size = int(rows.shape[0]) if rows.dim() else 0  # the kernel's grid: a shape, not a value
        spans = [written_spans(rows, prefix_lens, seq_lens, values, batch_size)]
        prefix = joined_prefixes(hook.arg(args, kwargs, "prefix_tensors"), hook.arg(args, kwargs, "prefix_lens_cpu"), values.device)
        if prefix is not None:
            import torch

            spans.append(written_spans(rows, torch.zeros_like(prefix_lens), prefix_lens, prefix, batch_size))
        written = [s for s in spans if s is not None]
        if not written:
            return
        if ledger.xp.sync_free_branching:
            for _, _, batch_rows, batch_ends in written:
                note_row_ends(state, table, batch_rows, batch_ends)
        slots, owners = written[0][:2]
        if len(written) > 1:
            import torch

            slots, owners = torch.cat([s[0] for s in written]), torch.cat([s[1] for s in written])
        with ledger.lock:
            ledger.on_owner(slots, owners)


def joined_prefixes(prefix_tensors: Any, prefix_lens_cpu: Any, device: Any) -> Any:
    """The prefix slots of the batch in request order, `prefix_lens_cpu[i]` of `prefix_tensors[i]`
    each (what the kernel copies), on `device`; None when no request has a prefix, or when the
    counts cannot be read on the host or a tensor is shorter than its count (then the prefix part
    is left out rather than given to the wrong rows)."""
    if not isinstance(prefix_tensors, (list, tuple)) or getattr(getattr(prefix_lens_cpu, "device", None), "type", None) != "cpu":
        return None
    counts = prefix_lens_cpu.reshape(-1).tolist()  # a host tensor: no device is waited for
    if len(counts) != len(prefix_tensors):
        return None
    parts = []
    for tensor, count in zip(prefix_tensors, counts, strict=False):
        if count <= 0:
            continue  # an empty prefix may be a host tensor beside device ones: never joined
        if not hasattr(tensor, "numel") or tensor.numel() < count:
            return None
        parts.append(tensor.reshape(-1)[:count])
    if not parts:
        return None
    import torch

    return torch.cat([part.to(device=device, dtype=torch.int64) for part in parts])
