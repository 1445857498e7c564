"""MoE finalize kernels (torch-facing wrappers): weighted top-k gather + shared expert, then
either the fused residual add + RMSNorm or a plain output for a collective to reduce first.

Index convention: see reference.py (indices[t, k] is a row of `routed`, negative = skip,
None = dense rows t * top_k + k).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._launch import DEBUG, address, check_rows, executor_for, explain_rows, launch, routing_weights, rows_ok
from .tiling import MAX_TOP_K, MoeVariant, check_hidden

__all__ = ["moe_finalize_add_rmsnorm", "moe_finalize", "prepare_moe_finalize", "handoff_args", "finalize_handoff_add_rmsnorm"]


_entries: dict = {}  # ((variant key), device) -> launcher entry, the per-call lookup


def _entry(dtype, hidden, top_k, indexed, shared, norm, weight_offset, device):
    key = ("moe", dtype, hidden, top_k, indexed, shared, norm, weight_offset)
    entry = _entries.get((key, device))
    if entry is None:
        check_hidden(hidden, dtype)
        entry = executor_for(key, device, lambda: MoeVariant(dtype, hidden, top_k, indexed, shared, norm, weight_offset), 8)
        _entries[(key, device)] = entry
    return entry


def prepare_moe_finalize(
    dtype: torch.dtype, hidden: int, top_k: int, *, indexed=True, shared=False, norm=True, weight_offset=0.0, device=None
) -> None:
    """Compile and load one MoE finalize variant now (before a CUDA graph capture)."""
    check_hidden(hidden, dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _entry(dtype, hidden, top_k, bool(indexed), bool(shared), bool(norm), float(weight_offset), device)


def _routing(routed, indices, weights):
    """Checked (routed rows R, indices int32 [T, k] | None, weights fp32 [T, k], T, k)."""
    if weights.dim() != 2:
        raise ValueError(f"weights must be [tokens, top_k], got {tuple(weights.shape)}")
    tokens, top_k = weights.shape
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k {top_k} must be in 1..{MAX_TOP_K}")
    hidden = routed.shape[-1]
    device = routed.device
    n_rows = routed.numel() // hidden if hidden else 0
    if not rows_ok(routed, routed.shape, routed.dtype, device):
        explain_rows("routed", routed, routed.shape, routed.dtype, device)
    if weights.device != device:
        raise ValueError(f"weights are on {weights.device}, routed rows on {device}")
    weights = routing_weights(weights)
    if indices is None:
        if n_rows < tokens * top_k:
            raise ValueError(f"dense routed rows need {tokens}*{top_k} rows, got {n_rows}")
    else:
        if indices.shape != weights.shape:
            raise ValueError(f"indices {tuple(indices.shape)} must match weights {(tokens, top_k)}")
        if indices.device != device:
            raise ValueError(f"indices are on {indices.device}, routed rows on {device}")
        if indices.dtype != torch.int32 or not indices.is_contiguous():
            indices = indices.to(torch.int32).contiguous()
        if DEBUG and tokens and int(indices.max()) >= n_rows:
            raise ValueError(f"an index ({int(indices.max())}) is past the {n_rows} routed rows")
    return indices, weights, tokens, top_k, hidden


def _launch_moe(entry, tokens, routed, indices, weights, shared, residual, gamma, residual_out, out, eps, device) -> None:
    """The MoE finalize kernel's launch: its eight addresses (0 for what the variant does not read)."""
    tensors = (routed, indices, weights, shared, residual, gamma, residual_out, out)
    launch(entry, tokens, [address(t) for t in tensors], eps, device)


def moe_finalize_add_rmsnorm(routed: torch.Tensor, indices: Optional[torch.Tensor], weights: torch.Tensor, residual: torch.Tensor,
                             gamma: torch.Tensor, eps: float, *, shared: Optional[torch.Tensor] = None, weight_offset: float = 0.0,
                             out: Optional[torch.Tensor] = None, residual_out: Optional[torch.Tensor] = None):
    """(normed, new_residual) of finalize + residual add + RMSNorm in one pass.

    total = sum_k weights[t,k] * routed[indices[t,k]] + shared[t] + residual[t] (fp32, never
    rounded in between); new_residual = round(total); normed = round(total * rstd * (gamma + offset)).
    routed: [R, H] or [T, top_k, H]; indices: [T, top_k] int32/int64 or None (dense);
    weights: [T, top_k]; shared, residual: [T, H]; gamma: [H]. `residual_out=residual` is in place.
    """
    indices, weights, tokens, top_k, hidden = _routing(routed, indices, weights)
    dtype, device = routed.dtype, routed.device
    shape = torch.Size((tokens, hidden))
    out = torch.empty_like(residual) if out is None else out
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    check_rows(dtype, device, shape, residual=residual, out=out, residual_out=residual_out, gamma=gamma, shared=shared)
    if tokens == 0:
        return out, residual_out
    if out.data_ptr() == residual_out.data_ptr():
        raise ValueError("out and residual_out must not be the same memory")
    entry = _entry(dtype, hidden, top_k, indices is not None, shared is not None, True, weight_offset, device)
    _launch_moe(entry, tokens, routed, indices, weights, shared, residual, gamma, residual_out, out, eps, device)
    return out, residual_out


def moe_finalize(routed: torch.Tensor, indices: Optional[torch.Tensor], weights: torch.Tensor, *, shared: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """finalized[t] = round(sum_k weights[t,k] * routed[indices[t,k]] + shared[t]), [T, H].

    For tensor parallelism without the fused collective: finalize, all-reduce, then
    `fused_add_rmsnorm` (the sum is rounded once here, before the collective)."""
    indices, weights, tokens, top_k, hidden = _routing(routed, indices, weights)
    dtype, device = routed.dtype, routed.device
    shape = torch.Size((tokens, hidden))
    out = torch.empty(shape, dtype=dtype, device=device) if out is None else out
    check_rows(dtype, device, shape, out=out, shared=shared)
    if tokens == 0:
        return out
    entry = _entry(dtype, hidden, top_k, indices is not None, shared is not None, False, 0.0, device)
    _launch_moe(entry, tokens, routed, indices, weights, shared, None, None, None, out, 0.0, device)
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
