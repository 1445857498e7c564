"""MoE finalize kernels (torch-facing wrappers): weighted top-k gather + shared expert, then
either the fused residual add + RMSNorm or a plain output for a collective to reduce first.

Index convention: see reference.py (indices[t, k] is a row of `routed`, negative = skip,
None = dense rows t * top_k + k).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._launch import DEBUG, as_rows, check_rows, executor_for, launch
from .tiling import MAX_TOP_K, MoeVariant, check_hidden

__all__ = ["moe_finalize_add_rmsnorm", "moe_finalize", "prepare_moe_finalize", "handoff_args", "finalize_handoff_add_rmsnorm"]


def _entry(dtype, hidden, top_k, indexed, shared, norm, weight_offset, device):
    key = ("moe", dtype, hidden, top_k, indexed, shared, norm, weight_offset)
    return executor_for(key, device, lambda: MoeVariant(dtype, hidden, top_k, indexed, shared, norm, weight_offset))


def prepare_moe_finalize(
    dtype: torch.dtype, hidden: int, top_k: int, *, indexed=True, shared=False, norm=True, weight_offset=0.0, device=None
) -> None:
    """Compile and load one MoE finalize variant now (before a CUDA graph capture)."""
    check_hidden(hidden, dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _entry(dtype, hidden, top_k, bool(indexed), bool(shared), bool(norm), float(weight_offset), device)


def _routing(routed, indices, weights):
    """Checked (routed [R, H], indices int32 [T, k] | None, weights fp32 [T, k], T, k)."""
    if weights.dim() != 2:
        raise ValueError(f"weights must be [tokens, top_k], got {tuple(weights.shape)}")
    tokens, top_k = weights.shape
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k {top_k} must be in 1..{MAX_TOP_K}")
    hidden = routed.shape[-1]
    r2 = as_rows(routed, hidden)
    device = routed.device
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()  # small [T, k]: a copy is cheap
    if weights.device != device:
        raise ValueError(f"weights are on {weights.device}, routed rows on {device}")
    if indices is None:
        if r2.shape[0] < tokens * top_k:
            raise ValueError(f"dense routed rows need {tokens}*{top_k} rows, got {r2.shape[0]}")
    else:
        if tuple(indices.shape) != (tokens, top_k):
            raise ValueError(f"indices {tuple(indices.shape)} must match weights {(tokens, top_k)}")
        if indices.device != device:
            raise ValueError(f"indices are on {indices.device}, routed rows on {device}")
        if indices.dtype != torch.int32 or not indices.is_contiguous():
            indices = indices.to(torch.int32).contiguous()
        if DEBUG and tokens and int(indices.max()) >= r2.shape[0]:
            raise ValueError(f"an index ({int(indices.max())}) is past the {r2.shape[0]} routed rows")
    check_rows("routed", r2, r2.shape[0], hidden, routed.dtype, device)
    return r2, indices, weights, tokens, top_k


def moe_finalize_add_rmsnorm(
    routed: torch.Tensor,
    indices: Optional[torch.Tensor],
    weights: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    *,
    shared: Optional[torch.Tensor] = None,
    weight_offset: float = 0.0,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
):
    """(normed, new_residual) of finalize + residual add + RMSNorm in one pass.

    total = sum_k weights[t,k] * routed[indices[t,k]] + shared[t] + residual[t] (fp32, never
    rounded in between); new_residual = round(total); normed = round(total * rstd * (gamma + offset)).
    routed: [R, H] or [T, top_k, H]; indices: [T, top_k] int32/int64 or None (dense);
    weights: [T, top_k]; shared, residual: [T, H]; gamma: [H]. `residual_out=residual` is in place.
    """
    r2, indices, weights, tokens, top_k = _routing(routed, indices, weights)
    hidden, dtype, device = r2.shape[1], r2.dtype, r2.device
    check_hidden(hidden, dtype)
    res2 = as_rows(residual, hidden)
    out = torch.empty_like(residual) if out is None else out
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    o2, ro2 = as_rows(out, hidden), as_rows(residual_out, hidden)
    for name, t in (("residual", res2), ("out", o2), ("residual_out", ro2)):
        check_rows(name, t, tokens, hidden, dtype, device)
    check_rows("gamma", gamma.view(1, -1), 1, hidden, dtype, device)
    s2 = None
    if shared is not None:
        s2 = as_rows(shared, hidden)
        check_rows("shared", s2, tokens, hidden, dtype, device)
    if tokens and o2.data_ptr() == ro2.data_ptr():
        raise ValueError("out and residual_out must not be the same memory")
    if tokens == 0:
        return out, residual_out
    entry = _entry(dtype, hidden, top_k, indices is not None, s2 is not None, True, float(weight_offset), device)
    addresses = [
        r2.data_ptr(),
        0 if indices is None else indices.data_ptr(),
        weights.data_ptr(),
        0 if s2 is None else s2.data_ptr(),
        res2.data_ptr(),
        gamma.data_ptr(),
        ro2.data_ptr(),
        o2.data_ptr(),
    ]
    launch(entry, tokens, addresses, float(eps), device)
    return out, residual_out


def moe_finalize(
    routed: torch.Tensor,
    indices: Optional[torch.Tensor],
    weights: torch.Tensor,
    *,
    shared: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """finalized[t] = round(sum_k weights[t,k] * routed[indices[t,k]] + shared[t]), [T, H].

    For tensor parallelism without the fused collective: finalize, all-reduce, then
    `fused_add_rmsnorm` (the sum is rounded once here, before the collective)."""
    r2, indices, weights, tokens, top_k = _routing(routed, indices, weights)
    hidden, dtype, device = r2.shape[1], r2.dtype, r2.device
    check_hidden(hidden, dtype)
    out = torch.empty((tokens, hidden), dtype=dtype, device=device) if out is None else out
    o2 = as_rows(out, hidden)
    check_rows("out", o2, tokens, hidden, dtype, device)
    s2 = None
    if shared is not None:
        s2 = as_rows(shared, hidden)
        check_rows("shared", s2, tokens, hidden, dtype, device)
    if tokens == 0:
        return out
    entry = _entry(dtype, hidden, top_k, indices is not None, s2 is not None, False, 0.0, device)
    addresses = [
        r2.data_ptr(),
        0 if indices is None else indices.data_ptr(),
        weights.data_ptr(),
        0 if s2 is None else s2.data_ptr(),
        0,
        0,
        0,
        o2.data_ptr(),
    ]
    launch(entry, tokens, addresses, 0.0, device)
    return out


def handoff_args(handoff):
    """(routed, indices, weights, shared) of a core `MoeFinalizeHandoff`.

    Its `expert_rows` are dense ([T, top_k, H]: token t's k-th expert output at [t, k]), so
    indices is None; its own `indices` are expert ids, not rows, and are not needed here."""
    rows = handoff.expert_rows
    if not rows.is_contiguous():
        rows = rows.contiguous()
    return rows, None, handoff.weights, handoff.shared


def finalize_handoff_add_rmsnorm(handoff, residual: torch.Tensor, norm, *, residual_out=None, out=None):
    """Finalize a local `MoeFinalizeHandoff` (no collective: its group must be of size 1)
    together with the add + norm of a core `RMSNorm`/`GemmaRMSNorm` (its eps and multiplier)."""
    group = getattr(handoff, "group", None)
    if group is not None and getattr(group, "size", 1) != 1:
        raise ValueError(f"the handoff still owes an all-reduce over {group.size} ranks; run moe_finalize, the collective, then fused_add_rmsnorm")
    routed, indices, weights, shared = handoff_args(handoff)
    offset = float(getattr(norm, "offset", 0.0))
    return moe_finalize_add_rmsnorm(
        routed, indices, weights, residual, norm.weight.detach(), norm.eps,
        shared=shared, weight_offset=offset, out=out, residual_out=residual_out,
    )
