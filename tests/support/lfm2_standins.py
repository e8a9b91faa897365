"""Torch stand-ins for the layer math of the tiny LFM2 (a hybrid model: short-conv layers with a
per-request conv state in SGLang's `MambaPool`, beside full-attention layers), so that a real SGLang
0.5.23 server serves it on this CPU machine. Imported by the server tests' sitecustomize where
KVDOCTOR_TEST_LFM2_STANDINS is set.

Only the layer math is stood in; SGLang's pools (`HybridReqToTokenPool`, `MambaPool`,
`MambaSlotAllocator`), scheduler, radix tree (`UnifiedRadixCache`, FULL + MAMBA) and allocators run
as they are:
- `sglang.srt.layers.attention.mamba.causal_conv1d.causal_conv1d_fn` and `causal_conv1d_update`
  (on CPU they reach Triton kernels): a depthwise causal conv over the varlen batch, starting from
  and writing back each request's conv state in place, as the kernels' docstrings say (checked
  against transformers' own `Lfm2ForCausalLM` on the same weights when this was written);
- `torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu` and `fused_gdn_gating_cpu`:
  looked up (never called) when the GDN backend module loads, which SGLang imports for every
  hybrid linear-attention model; registered as ops that raise if called.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

PAD_SLOT_ID = -1


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    query_start_loc=None,
    cache_indices=None,
    has_initial_state=None,
    conv_states=None,
    activation="silu",
    pad_slot_id=PAD_SLOT_ID,
    **kwargs,
):
    """x (dim, tokens), varlen by `query_start_loc`; request i starts from conv_states[cache_indices[i]]
    where has_initial_state[i], which then holds the last width-1 inputs of (state ++ request i)."""
    import torch
    import torch.nn.functional as F

    activation = ("silu" if activation else None) if isinstance(activation, bool) else activation
    batched = x.dim() == 3
    if batched:  # (batch, dim, seqlen) as varlen
        b, d, n = x.shape
        x = x.transpose(0, 1).reshape(d, b * n)
        query_start_loc = torch.arange(0, (b + 1) * n, n, dtype=torch.int32)
    dim, total = x.shape
    state_len = weight.shape[1] - 1
    out = torch.empty_like(x)
    starts = [0, total] if query_start_loc is None else [int(v) for v in query_start_loc.tolist()]
    w, bias_f = weight.float().unsqueeze(1), (bias.float() if bias is not None else None)
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        line = int(cache_indices[i]) if cache_indices is not None else i
        if cache_indices is not None and line == pad_slot_id:
            continue
        seq = x[:, s:e].float()
        if conv_states is not None and has_initial_state is not None and bool(has_initial_state[i]) and state_len:
            init = conv_states[line, :, -state_len:].float()
        else:
            init = seq.new_zeros(dim, state_len)
        full = torch.cat([init, seq], dim=1)
        y = F.conv1d(full.unsqueeze(0), w, bias_f, groups=dim).squeeze(0)
        out[:, s:e] = (F.silu(y) if activation in ("silu", "swish") else y).to(out.dtype)
        if conv_states is not None and state_len:
            conv_states[line, :, -state_len:] = full[:, -state_len:].to(conv_states.dtype)
    if batched:
        out = out.reshape(d, b, n).transpose(0, 1)
    return out


def causal_conv1d_update(
    x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None, pad_slot_id=PAD_SLOT_ID, **kwargs
):
    """x (batch, dim[, seqlen]); request b's state conv_state[conv_state_indices[b]] is shifted left
    and appended in place (no circular buffer, no speculative window: LFM2's decode uses neither)."""
    import torch
    import torch.nn.functional as F

    if cache_seqlens is not None or any(kwargs.get(k) is not None for k in ("intermediate_conv_window", "num_accept_tokens")):
        raise NotImplementedError("the LFM2 stand-in has no circular or speculative conv state")
    activation = ("silu" if activation else None) if isinstance(activation, bool) else activation
    single = x.dim() == 2
    if single:
        x = x.unsqueeze(-1)
    batch, dim, seqlen = x.shape
    width, state_len = weight.shape[1], conv_state.shape[-1]
    out = torch.empty_like(x)
    w, bias_f = weight.float().unsqueeze(1), (bias.float() if bias is not None else None)
    for b in range(batch):
        line = int(conv_state_indices[b]) if conv_state_indices is not None else b
        if line == pad_slot_id:
            continue
        full = torch.cat([conv_state[line].float(), x[b].float()], dim=1)
        y = F.conv1d(full[:, -(width - 1 + seqlen) :].unsqueeze(0), w, bias_f, groups=dim).squeeze(0)
        out[b] = (F.silu(y) if activation in ("silu", "swish") else y).to(out.dtype)
        conv_state[line] = full[:, -state_len:].to(conv_state.dtype)
    return out.squeeze(-1) if single else out


def _conv_module(module: Any) -> None:
    module.causal_conv1d_fn = causal_conv1d_fn
    module.causal_conv1d_update = causal_conv1d_update


_LIBRARIES: list[Any] = []


def _kernel_names(module: Any) -> None:
    import torch

    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    _LIBRARIES.append(library)
    for name in ("fused_sigmoid_gating_delta_rule_update_cpu", "fused_gdn_gating_cpu"):
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        library.define(f"{name}(Tensor x) -> Tensor")

        def unavailable(x: Any, _name: str = name) -> Any:
            raise RuntimeError(f"sgl-kernel op {_name} is not available here (a name looked up at import)")

        library.impl(name, unavailable, "CompositeExplicitAutograd")


AFTER_IMPORT = {
    "sgl_kernel": _kernel_names,
    "sglang.srt.layers.attention.mamba.causal_conv1d": _conv_module,
    "sglang.srt.models.lfm2": _conv_module,  # in case it bound the names first
}


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs AFTER_IMPORT's function on a module once it has been executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader, then = spec.loader, AFTER_IMPORT[fullname]

        class Then(importlib.abc.Loader):
            def create_module(self, s: Any) -> Any:
                return loader.create_module(s)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                then(module)

        spec.loader = Then()
        return spec


sys.meta_path.insert(0, AfterImport())
