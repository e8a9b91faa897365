"""Torch bodies for the few sgl-kernel names a whole SGLang 0.5.23 server calls on the GPU
(bench/gpu/server_pack.sh appends this to the import-only stand-in of tests/support/sgl_kernel,
whose every other name resolves to a placeholder that raises if called).

sgl-kernel's wheels are built for another torch/CUDA than the device machine's, so the real
package cannot be installed there. None of these is on kvdoctor's path: the probe hooks SGLang's
Python allocators, request table and trees, and the row writes' Triton kernels are SGLang's own.

- `weak_ref_tensor` (the CUDA graph runners keep weak references to a graph's output buffers):
  returns the tensor itself. sgl-kernel's makes a tensor over the same storage without owning it;
  here the reference is strong, which keeps the graph's outputs alive as long as the runner does
  (their memory belongs to the graph pool either way).
- `utils.is_arch_support_pdl` (the Triton attention backend asks whether to launch with
  programmatic dependent launch): False, a truthful answer for a stand-in without those kernels.
- `rmsnorm`, `fused_add_rmsnorm`, `silu_and_mul`, `gelu_and_mul`: plain torch, in case a layer
  reaches them (SGLang 0.5.23 runs its Llama through its own JIT kernels on CUDA).
- `kvcacheio.transfer_kv_direct` (HiCache's `direct` I/O backend, layer-first layout): index
  copies per layer, as bench/gpu/common.py's install_direct_transfer.
"""

import torch


def weak_ref_tensor(tensor):
    return tensor


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    x = input.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(input.dtype) * weight
    if out is not None:
        out.copy_(y)
        return out
    return y


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(rmsnorm(residual, weight, eps))


def silu_and_mul(input, out=None):
    d = input.shape[-1] // 2
    y = torch.nn.functional.silu(input[..., :d]) * input[..., d:]
    if out is not None:
        out.copy_(y)
        return out
    return y


def gelu_and_mul(input, out=None):
    d = input.shape[-1] // 2
    y = torch.nn.functional.gelu(input[..., :d]) * input[..., d:]
    if out is not None:
        out.copy_(y)
        return out
    return y
