"""The cutedsl plugin's q/k norm + rope: the `QKNormRopeKernel` record "cutedsl.qk_norm_rope".

A qwen3-style attention normalizes every query and key head over head_dim (q_norm, k_norm) and
then rotates them: three launches a layer unfused. `fused_qk_norm_rope` (kernels/qk_norm_rope.py)
does all three in one, reading q and k where the fused q/k/v projection left them and writing
new contiguous tensors.

The factory declines (returns None) off CUDA, for dtypes other than bf16/fp16, head_dim other
than 64/128/256, nvidia-cutlass-dsl missing, and a compile or first launch that fails (a
warning says why). It builds the float32 cos/sin table for `request.max_positions` and runs
one launch, so a later call may run inside a CUDA-graph capture. Under torch.compile a call is
the custom op `layer_boundary_cutedsl::qk_norm_rope` (a fake gives the shapes); eager calls
launch directly.
"""

from __future__ import annotations

from typing import Optional

import torch

from layer_boundary.plugin import rope_cos_sin_table

from .kernel_set import model_kernel_reason, trial_factory
from .kernels.qk_norm_rope import HEAD_DIMS, fused_qk_norm_rope, prepare_qk_norm_rope

__all__ = ["CuteQKNormRope", "factory", "reason"]


def reason(request) -> Optional[str]:
    """Why the kernel cannot run `request` (None: it can, once compiled)."""
    return model_kernel_reason(request, None if request.head_dim in HEAD_DIMS else f"head_dim {request.head_dim}")


class CuteQKNormRope:
    """`(q [T, heads, D], k [T, kv_heads, D], positions [T], q_weight, k_weight) -> (q, k)`:
    normalized per head, then rotated; new contiguous tensors."""

    def __init__(self, table: torch.Tensor, eps: float):
        self.table = table
        self.eps = eps

    def __call__(self, q, k, positions, q_weight, k_weight):
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_cutedsl.qk_norm_rope(q, k, positions, q_weight, k_weight, self.table, self.eps)
        return fused_qk_norm_rope(q, k, positions, q_weight, k_weight, self.table, self.eps)

    def __repr__(self) -> str:
        return f"CuteQKNormRope(max_positions={self.table.shape[0]}, head_dim={self.table.shape[1]}, eps={self.eps})"


def _trial(request) -> CuteQKNormRope:
    prepare_qk_norm_rope(request.dtype, request.head_dim, request.heads, request.kv_heads, request.device)
    kernel = CuteQKNormRope(rope_cos_sin_table(request.head_dim, request.theta, request.max_positions, request.device), request.eps)
    D = request.head_dim
    q = torch.ones(1, request.heads, D, dtype=request.dtype, device=request.device)
    k = torch.ones(1, request.kv_heads, D, dtype=request.dtype, device=request.device)
    weight = torch.ones(D, dtype=request.dtype, device=request.device)
    kernel(q, k, torch.zeros(1, dtype=torch.long, device=request.device), weight, weight)
    return kernel


def factory(request) -> Optional[CuteQKNormRope]:
    """The record's factory: the table, the compiled kernel, one trial launch."""
    return trial_factory("cutedsl.qk_norm_rope", request, reason(request), lambda: _trial(request), f"{request.dtype}")


# the custom op torch.compile traces ---------------------------------------------------------------


@torch.library.custom_op("layer_boundary_cutedsl::qk_norm_rope", mutates_args=())
def _qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    table: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_qk_norm_rope(q, k, positions, q_weight, k_weight, table, eps)


@_qk_norm_rope.register_fake
def _(q, k, positions, q_weight, k_weight, table, eps):
    return q.new_empty(q.shape), k.new_empty(k.shape)
