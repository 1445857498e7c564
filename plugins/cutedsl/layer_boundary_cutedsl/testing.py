"""Test support: the float64 references as a `KernelSet`, so a whole model, its service, its
decisions and its collectives run with the plugin on CPU ranks (threaded or gloo worlds).

    fusion = CuteDSLFusion(kernels=reference_kernels(calls))   # calls: a list that records launches

Each "launch" computes the exact float64 result and rounds it once to the output dtype, as the
kernels do; it accepts any device and bf16/fp16/fp32/fp64 rows and fp32/fp64 norm statistics.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernel_set import KernelSet
from .kernels.reference import add_rmsnorm_reference, moe_finalize_add_rmsnorm_reference, moe_finalize_reference

__all__ = ["reference_kernels"]


def _into(result: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def reference_kernels(calls: Optional[list] = None) -> KernelSet:
    """The references as kernels; every launch appends (name, tokens, details) to `calls`."""

    def record(*entry):
        if calls is not None:
            calls.append(entry)

    def fused_add_rmsnorm(x, residual, gamma, eps, out=None, *, residual_out=None, weight_offset=0.0):
        record("fused_add_rmsnorm", x.shape[0], {"eps": eps, "weight_offset": weight_offset})
        normed, new_residual = add_rmsnorm_reference(x, residual, gamma, eps, weight_offset=weight_offset)
        return _into(normed, out), _into(new_residual, residual_out)

    def moe_finalize(routed, indices, weights, *, shared=None, out=None):
        record("moe_finalize", weights.shape[0], {"top_k": weights.shape[1], "shared": shared is not None, "into_buffer": out is not None})
        return _into(moe_finalize_reference(routed, indices, weights, shared), out)

    def moe_finalize_add_rmsnorm(routed, indices, weights, residual, gamma, eps, *, shared=None, weight_offset=0.0, out=None, residual_out=None):
        record("moe_finalize_add_rmsnorm", weights.shape[0], {"eps": eps, "weight_offset": weight_offset, "shared": shared is not None})
        normed, new_residual = moe_finalize_add_rmsnorm_reference(routed, indices, weights, shared, residual, gamma, eps, weight_offset=weight_offset)
        return _into(normed, out), _into(new_residual, residual_out)

    def prepare(dtype, hidden, device, add_norm_offsets, moe_shapes):
        record("prepare", 0, {"dtype": dtype, "hidden": hidden, "offsets": tuple(add_norm_offsets), "moe": tuple(moe_shapes)})

    return KernelSet(
        name="float64-reference",
        fused_add_rmsnorm=fused_add_rmsnorm,
        moe_finalize=moe_finalize,
        moe_finalize_add_rmsnorm=moe_finalize_add_rmsnorm,
        prepare=prepare,
        available=lambda: True,
        on_device=lambda t: True,
        dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
        norm_compute_dtypes=(torch.float32, torch.float64),
    )
