"""`CuteDSLFusion`: consumer candidates that finish what a layer owes with the CuTe DSL kernels.

A stage's fusion provider (core/layer_boundary/fusions.py). Its candidates take

- a `MoeFinalizeHandoff` (a deferred MoE finalize): over one rank, one kernel does finalize +
  residual add + RMSNorm; over several, `moe_finalize`, the handoff group's all-reduce, then
  `fused_add_rmsnorm` (the one-shot fused collective is not built: docs/fused_allreduce.md);
- an `UnreducedOutput` (a partial sum): its all-reduce, then `fused_add_rmsnorm`.

Each candidate declines (returns None, touching nothing) unless everything is on a CUDA device
in bf16/fp16 with a core RMSNorm computing in fp32 and a supported width, so the core's unfused
candidate still runs everywhere else. The new residual goes to a new tensor (the old one is
never written). Imports only torch and the kernels' wrappers; cutlass loads at the first launch.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import torch

from layer_boundary.contracts import FusedMlpInput
from layer_boundary.layers import MoeFinalizeHandoff
from layer_boundary.output import UnreducedOutput
from layer_boundary.residual.add_norm import is_rms_norm

from .kernels import fused_add_rmsnorm, moe_finalize, moe_finalize_add_rmsnorm
from .kernels.tiling import MAX_HIDDEN, MAX_TOP_K, SUPPORTED_DTYPES

__all__ = ["CuteDSLFusion", "kernels_available"]

#: the norm statistic dtypes whose semantics the kernels reproduce (they compute in fp32)
NORM_COMPUTE_DTYPES = (torch.float32,)


@functools.lru_cache(maxsize=None)
def kernels_available() -> bool:
    """nvidia-cutlass-dsl importable and a CUDA device visible."""
    return importlib.util.find_spec("cutlass") is not None and torch.cuda.is_available()


def _on_device(t: torch.Tensor) -> bool:
    return t.is_cuda


def _rows_fit(t, dtype, shape) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dtype == dtype
        and tuple(t.shape) == shape
        and _on_device(t)
        and t.is_contiguous()
        and t.data_ptr() % 16 == 0
    )


def _norm_args(norm, residual) -> Optional[tuple]:
    """(gamma, weight_offset, eps) when the kernels compute exactly what `norm` does, else None."""
    if not is_rms_norm(norm) or getattr(norm, "compute_dtype", torch.float32) not in NORM_COMPUTE_DTYPES:
        return None
    if not isinstance(residual, torch.Tensor) or residual.dim() != 2 or residual.dtype not in SUPPORTED_DTYPES:
        return None
    hidden = residual.shape[1]
    if hidden % 8 or hidden > MAX_HIDDEN:
        return None
    gamma = norm.weight.detach()
    if not _rows_fit(gamma, residual.dtype, (hidden,)) or not _rows_fit(residual, residual.dtype, tuple(residual.shape)):
        return None
    return gamma, float(getattr(type(norm), "offset", 0.0)), float(norm.eps)


def _group_size(group) -> int:
    return 1 if group is None else int(getattr(group, "size", 1))


def finalize_add_norm(norm, owed, residual, forward=None):
    """Candidate for a `MoeFinalizeHandoff`: (normed, new_residual), or None to decline."""
    if not isinstance(owed, MoeFinalizeHandoff) or not kernels_available():
        return None
    args = _norm_args(norm, residual)
    if args is None:
        return None
    gamma, offset, eps = args
    rows = owed.expert_rows
    tokens, hidden = residual.shape
    if not isinstance(rows, torch.Tensor) or rows.dim() != 3 or rows.shape[0] != tokens or rows.shape[2] != hidden:
        return None
    top_k = rows.shape[1]
    if not 1 <= top_k <= MAX_TOP_K or not _rows_fit(rows, residual.dtype, (tokens, top_k, hidden)):
        return None
    weights = owed.weights
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (tokens, top_k) or not weights.is_floating_point():
        return None
    if not _on_device(weights):
        return None
    shared = owed.shared
    if shared is not None and not _rows_fit(shared, residual.dtype, (tokens, hidden)):
        return None
    if _group_size(owed.group) == 1:
        return moe_finalize_add_rmsnorm(rows, None, weights, residual, gamma, eps, shared=shared, weight_offset=offset)
    partial = moe_finalize(rows, None, weights, shared=shared)
    total = owed.group.all_reduce(partial)
    return fused_add_rmsnorm(total, residual, gamma, eps, weight_offset=offset)


def all_reduce_add_norm(norm, owed, residual, forward=None):
    """Candidate for an `UnreducedOutput`: its all-reduce, then the fused add + norm."""
    if not isinstance(owed, UnreducedOutput) or not kernels_available():
        return None
    args = _norm_args(norm, residual)
    if args is None:
        return None
    gamma, offset, eps = args
    if not _rows_fit(owed.partial, residual.dtype, tuple(residual.shape)):
        return None
    total = owed.complete()
    if not _rows_fit(total, residual.dtype, tuple(residual.shape)):  # a collective may hand back a view
        total = total.contiguous()
    return fused_add_rmsnorm(total, residual, gamma, eps, weight_offset=offset)


class CuteDSLFusion:
    """Fusion provider of one stage (give a layer's attention and FFN stages the same one).

    `defer_finalize=True` lets this stage's MoE return a `MoeFinalizeHandoff` for the next
    input to finalize (`can_defer_finalize`); off by default, as the handoff then has to reach a
    consumer whose provider takes it (the core's unfused candidate otherwise finalizes it).
    """

    def __init__(self, *, defer_finalize: bool = False):
        self.defer_finalize = defer_finalize

    def attention_input(self, plan):
        norm = plan.norm
        return (
            FusedMlpInput(
                run=functools.partial(finalize_add_norm, norm), handoff=True, name="cutedsl.finalize_add_rmsnorm", preserves_residual=True
            ),
            FusedMlpInput(run=functools.partial(all_reduce_add_norm, norm), name="cutedsl.all_reduce_add_rmsnorm", preserves_residual=True),
        )

    ffn_input = attention_input

    def can_defer_finalize(self, plan, forward) -> bool:
        return self.defer_finalize and kernels_available()

    def __repr__(self) -> str:
        return f"CuteDSLFusion(defer_finalize={self.defer_finalize})"
