"""What a fused completion does, shared by the provider's candidates and the service.

- `finalize_add_norm`: a `MoeFinalizeHandoff` -> (normed, new_residual). Over one rank one
  kernel (finalize + add + norm); over several, `moe_finalize`, the handoff group's all-reduce
  (its `Collectives`: NCCL on GPUs), then `fused_add_rmsnorm`.
- `all_reduce_add_norm`: an `UnreducedOutput` -> its all-reduce, then `fused_add_rmsnorm`.

Both return None, before touching anything or starting a collective, when the kernels cannot
take the tensors; once a collective has run they always finish (falling back to torch code with
the kernels' semantics if a reduced value comes back in a form the kernels cannot read). Either
way a rank issues exactly the one all-reduce the unfused path would, of the same shape, so a rank
that declines and one that fuses still meet in the same collective.
"""

from __future__ import annotations

from typing import Optional

import torch

from layer_boundary import MoeFinalizeHandoff, UnreducedOutput
from layer_boundary.plugin import is_rms_norm

from .kernels.tiling import MAX_TOP_K

__all__ = ["norm_args", "finalize_add_norm", "all_reduce_add_norm", "unfused_add_norm", "handoff_fits"]


def _width_ok(kernels, residual) -> bool:
    return (
        isinstance(residual, torch.Tensor)
        and residual.dim() == 2
        and residual.dtype in kernels.dtypes
        and residual.shape[1] % 8 == 0
        and 0 < residual.shape[1] <= kernels.max_hidden
        and kernels.takes_rows(residual, residual.dtype, tuple(residual.shape))
    )


def norm_args(kernels, norm, residual) -> Optional[tuple]:
    """(gamma, weight_offset, eps) when the kernels compute exactly what `norm` does, else None."""
    if not is_rms_norm(norm) or getattr(norm, "compute_dtype", torch.float32) not in kernels.norm_compute_dtypes:
        return None
    if not _width_ok(kernels, residual):
        return None
    gamma = norm.weight.detach()
    if not kernels.takes_rows(gamma, residual.dtype, (residual.shape[1],)):
        return None
    return gamma, float(getattr(type(norm), "offset", 0.0)), float(norm.eps)


def _group_size(group) -> int:
    return 1 if group is None else int(getattr(group, "size", 1))


def handoff_fits(kernels, owed, residual, gamma) -> bool:
    """Whether the kernels take this handoff with this residual and multiplier (no side effects)."""
    if not isinstance(owed, MoeFinalizeHandoff) or not _width_ok(kernels, residual):
        return False
    tokens, hidden = residual.shape
    dtype = residual.dtype
    rows = owed.expert_rows
    if not isinstance(rows, torch.Tensor) or rows.dim() != 3 or rows.shape[0] != tokens or rows.shape[2] != hidden:
        return False
    top_k = rows.shape[1]
    if not 1 <= top_k <= MAX_TOP_K or not kernels.takes_rows(rows, dtype, (tokens, top_k, hidden)):
        return False
    weights = owed.weights
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (tokens, top_k) or not weights.is_floating_point():
        return False
    if not kernels.on_device(weights):
        return False
    if owed.shared is not None and not kernels.takes_rows(owed.shared, dtype, (tokens, hidden)):
        return False
    return kernels.takes_rows(gamma, dtype, (hidden,))


def unfused_add_norm(value, residual, gamma, eps, weight_offset=0.0):
    """The kernels' semantics in torch: the sum in max(dtype, fp32), rounded once into the new
    residual; the norm `round(sum * rstd * (gamma + offset))` from the unrounded sum."""
    acc = torch.promote_types(residual.dtype, torch.float32)
    total = value.to(acc) + residual.to(acc)
    new_residual = total.to(residual.dtype)
    if total.shape[0] == 0:
        return new_residual.clone(), new_residual
    rstd = torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    normed = (total * rstd * (gamma.to(acc) + weight_offset)).to(residual.dtype)
    return normed, new_residual


def _readable(kernels, total, like):
    if kernels.takes_rows(total, like.dtype, tuple(like.shape)):
        return total
    copy = total.to(like.dtype).clone(memory_format=torch.contiguous_format)
    return copy if kernels.takes_rows(copy, like.dtype, tuple(like.shape)) else None


def _add_norm_after_collective(kernels, total, residual, gamma, offset, eps):
    readable = _readable(kernels, total, residual)
    if readable is None:
        return unfused_add_norm(total, residual, gamma, eps, offset)
    return kernels.fused_add_rmsnorm(readable, residual, gamma, eps, weight_offset=offset)


def finalize_add_norm(kernels, owed, residual, gamma, offset, eps, *, partial_out=None):
    """(normed, new_residual) of a MoE finalize handoff, or None (untouched) when the kernels
    cannot take it. `partial_out`: a [T, H] buffer for the finalized partial before the
    collective (the service's workspace), or None to allocate."""
    if not kernels.available() or not handoff_fits(kernels, owed, residual, gamma):
        return None
    rows, weights, shared = owed.expert_rows, owed.weights, owed.shared
    if _group_size(owed.group) == 1:
        return kernels.moe_finalize_add_rmsnorm(rows, None, weights, residual, gamma, eps, shared=shared, weight_offset=offset)
    if partial_out is not None and not kernels.takes_rows(partial_out, residual.dtype, tuple(residual.shape)):
        partial_out = None
    partial = kernels.moe_finalize(rows, None, weights, shared=shared, out=partial_out)
    total = owed.group.all_reduce(partial)
    return _add_norm_after_collective(kernels, total, residual, gamma, offset, eps)


def all_reduce_add_norm(kernels, owed, residual, gamma, offset, eps):
    """(normed, new_residual) of a partial sum: its all-reduce, then the fused add + norm; or
    None (untouched) when the kernels cannot take it."""
    if not isinstance(owed, UnreducedOutput) or not kernels.available() or not _width_ok(kernels, residual):
        return None
    partial = owed.partial
    if not isinstance(partial, torch.Tensor) or partial.dtype != residual.dtype or partial.shape != residual.shape:
        return None
    if not kernels.takes_rows(gamma, residual.dtype, (residual.shape[1],)):
        return None
    total = owed.complete()
    return _add_norm_after_collective(kernels, total, residual, gamma, offset, eps)
