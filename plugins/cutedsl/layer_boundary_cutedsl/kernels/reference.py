"""Float64 torch references for the kernels: the exact math, rounded once to the output dtype.

The kernels are checked against these (not against another bf16 implementation) so that a
test's tolerance is the bf16 rounding of the output plus the kernel's fp32 error, nothing else.

Index convention of the MoE finalize (shared by the kernels):

- `routed` holds expert output rows, `[R, H]` (or `[T, top_k, H]`, viewed as `[T*top_k, H]`);
- `indices[t, k]` (int32 or int64) is the row of `routed` that holds token `t`'s output from its
  `k`-th chosen expert; a negative index means "no contribution" (an expert on another rank, a
  dropped token) and that slot is skipped, its weight ignored;
- `indices=None` means the dense layout: row `t * top_k + k` (a `[T, top_k, H]` tensor such as
  `MoeFinalizeHandoff.expert_rows`);
- `weights[t, k]` (fp32, or any float dtype) scales that row;
- `shared` (optional, `[T, H]`) is added once per token.

finalized[t] = sum_k weights[t, k] * routed[indices[t, k]] + shared[t]
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "add_rmsnorm_reference", "add_norms_reference", "moe_finalize_reference", "moe_finalize_add_rmsnorm_reference", "dense_indices",
    "qk_norm_rope_reference",
]


def _rmsnorm64(total: torch.Tensor, gamma: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    g = gamma.to(torch.float64) + weight_offset
    if total.shape[0] == 0:
        return total.new_empty(total.shape)
    rstd = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    return total * rstd * g


def add_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float, *, weight_offset: float = 0.0, exact: bool = False
):
    """(normed, new_residual) of a residual add + RMSNorm.

    `weight_offset=1.0` is the Gemma `(1 + w)` multiplier. With `exact=True` both come back in
    float64 (the unrounded values, for error bounds); otherwise each is rounded once to x's dtype.
    """
    total = x.to(torch.float64) + residual.to(torch.float64)
    normed = _rmsnorm64(total, gamma, eps, weight_offset)
    if exact:
        return normed, total
    return normed.to(x.dtype), total.to(residual.dtype)


def add_norms_reference(x, residual, gamma, beta, post_gamma, eps: float, post_eps: float, shape, *, exact: bool = False):
    """(normed, new_residual) of the norms kernels (kernels/norms.py, a `NormsShape`): with a
    post-norm, x's RMS post-norm rounded once to x's dtype; the sum with the residual; the read's
    RMSNorm, LayerNorm (the centered row's variance) or nothing (an identity read: the new residual
    twice). Each output rounded once to the residual's dtype (`exact`: both in float64)."""
    x64 = x.to(torch.float64)
    if shape.post:
        x64 = _rmsnorm64(x64, post_gamma, post_eps, shape.post_offset).to(x.dtype).to(torch.float64)
    total = x64 + residual.to(torch.float64)
    if shape.norm == "none":
        normed = total
    elif shape.norm == "rms":
        normed = _rmsnorm64(total, gamma, eps, shape.weight_offset)
    else:
        centered = total - total.mean(-1, keepdim=True)
        normed = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * gamma.to(torch.float64)
        if shape.bias:
            normed = normed + beta.to(torch.float64)
    if exact:
        return normed, total
    new_residual = total.to(residual.dtype)
    return (new_residual if shape.norm == "none" else normed.to(residual.dtype)), new_residual


def dense_indices(tokens: int, top_k: int, device=None) -> torch.Tensor:
    """The indices of the dense layout: `indices[t, k] = t * top_k + k`."""
    return torch.arange(tokens * top_k, dtype=torch.int32, device=device).view(tokens, top_k)


def _gather64(routed, indices, weights, shared):
    weights = weights.to(torch.float64)
    tokens, top_k = weights.shape
    hidden = routed.shape[-1]
    rows = routed.reshape(-1, hidden).to(torch.float64)
    if indices is None:
        indices = dense_indices(tokens, top_k, device=routed.device)
    indices = indices.to(torch.int64)
    if indices.shape != weights.shape:
        raise ValueError(f"indices {tuple(indices.shape)} and weights {tuple(weights.shape)} differ")
    valid = indices >= 0
    picked = rows[indices.clamp(min=0)]  # [T, top_k, H]
    w = torch.where(valid, weights, torch.zeros_like(weights))
    # terms kept separately: sum of |terms| bounds the fp32 accumulation error in the tests
    terms = picked * w.unsqueeze(-1)
    if shared is not None:
        terms = torch.cat([terms, shared.to(torch.float64).unsqueeze(1)], dim=1)
    return terms


def moe_finalize_reference(
    routed: torch.Tensor,
    indices: Optional[torch.Tensor],
    weights: torch.Tensor,
    shared: Optional[torch.Tensor] = None,
    *,
    out_dtype: Optional[torch.dtype] = None,
    exact: bool = False,
) -> torch.Tensor:
    """finalized[t] = sum_k weights[t,k] * routed[indices[t,k]] (+ shared[t]); see the module doc."""
    total = _gather64(routed, indices, weights, shared).sum(dim=1)
    return total if exact else total.to(out_dtype or routed.dtype)


def moe_finalize_add_rmsnorm_reference(
    routed: torch.Tensor,
    indices: Optional[torch.Tensor],
    weights: torch.Tensor,
    shared: Optional[torch.Tensor],
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    *,
    weight_offset: float = 0.0,
    exact: bool = False,
):
    """(normed, new_residual) of finalize + residual add + RMSNorm, one rounding each."""
    total = moe_finalize_reference(routed, indices, weights, shared, exact=True) + residual.to(torch.float64)
    normed = _rmsnorm64(total, gamma, eps, weight_offset)
    if exact:
        return normed, total
    return normed.to(residual.dtype), total.to(residual.dtype)


def moe_terms_abs_sum(routed, indices, weights, shared, residual) -> torch.Tensor:
    """Per element sum of |terms| of the finalize + residual sum: fp32 accumulation error bound scale."""
    terms = _gather64(routed, indices, weights, shared).abs().sum(dim=1)
    return terms + residual.to(torch.float64).abs()


def qk_norm_rope_reference(x: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, eps: float) -> torch.Tensor:
    """The q/k norm + rope kernel's math on one of q or k ([T, heads, D]) in float64: the head's
    RMSNorm times its weight, rounded to x's dtype (as FlashInfer's rmsnorm hands it to the rope), then the
    half-split rotation by table[positions] (cos | sin halves), rounded once."""
    half = x.shape[-1] // 2
    x64 = x.to(torch.float64)
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    normed = (x64 * rstd * weight.to(torch.float64)).to(x.dtype).to(torch.float64)
    angles = table[positions].to(torch.float64)[:, None, :]  # [T, 1, D]
    cos, sin = angles[..., :half], angles[..., half:]
    first, second = normed[..., :half], normed[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)
