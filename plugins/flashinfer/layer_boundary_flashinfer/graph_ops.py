"""The fused FlashInfer kernels as graph nodes: one `torch.library` custom op per kernel call, so
that a chosen fused candidate is one node of a `torch.compile(fullgraph=True)` graph.

A tracer cannot follow a launch (a JIT module's function over a workspace of peer pointers, a
16-byte alignment test on `data_ptr()`), so inside a compiled region each candidate calls its op
instead, with the tensors it was given and its *graph key* (a string: `register_graph_object`
gave it one when it was bound, eagerly). At run time the op finds the candidate by that key and
runs its bound launcher as the eager call does (alignment copies included); the workspace, the
norm weight, eps and the one-shot table stay with the launcher, where `bind` put them.

Schemas: the kernels read `x` / `rows` / `residual` and write only new tensors (the normed rows,
the new residual, FP8 data and scales) and the group's workspace, which is reached through the
launcher, not passed. So no tensor argument is mutated and `mutates_args=()` is the truthful
declaration; the fake implementations give the output shapes and dtypes. Eager calls go to the
launchers directly and pay no dispatcher time (decode calls them once per boundary).
"""

from __future__ import annotations

from typing import Optional

import torch

from layer_boundary.plugin import FP8_DTYPE, graph_object

__all__ = ["ALL_REDUCE_ADD_RMSNORM", "ALL_REDUCE_ADD_RMSNORM_FP8", "FINALIZE_ALL_REDUCE_ADD_RMSNORM", "FUSED_OPS"]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a contiguous 16-byte-aligned copy (the kernels load 16-byte vectors)."""
    if t.is_contiguous() and not t.data_ptr() & 15:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _launcher(key: str, what: str):
    launch = graph_object(key).launch
    if launch is None:
        raise RuntimeError(
            f"the {what} candidate {key!r} was unbound after this graph was compiled (its workspace was released or "
            "rebuilt); call prepare_flashinfer_fusion(model) again before the next compiled call"
        )
    return launch


def _fresh(t: torch.Tensor, inputs) -> torch.Tensor:
    """`t`, or a copy where it is one of the op's inputs (a custom op's outputs never alias them)."""
    return t.clone() if any(t is i for i in inputs) else t


@torch.library.custom_op("layer_boundary_flashinfer::all_reduce_add_rmsnorm", mutates_args=())
def _all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, candidate: str) -> tuple[torch.Tensor, torch.Tensor]:
    normed, new_residual = _launcher(candidate, "all-reduce + add + RMSNorm")(_aligned(x), _aligned(residual), x.shape[0])
    return _fresh(normed, (x, residual)), _fresh(new_residual, (x, residual))


@_all_reduce_add_rmsnorm.register_fake
def _(x, residual, candidate):
    return torch.empty_like(residual, memory_format=torch.contiguous_format), torch.empty_like(
        residual, memory_format=torch.contiguous_format
    )


@torch.library.custom_op("layer_boundary_flashinfer::all_reduce_add_rmsnorm_fp8", mutates_args=())
def _all_reduce_add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor, candidate: str, per_token: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    quant, new_residual = _launcher(candidate, "all-reduce + add + RMSNorm + FP8")(_aligned(x), _aligned(residual), x.shape[0])
    scale = quant.scale if per_token else quant.scale.reshape(()).clone()  # a fixed scale: the launcher keeps it
    return quant.data, scale, _fresh(new_residual, (x, residual))


@_all_reduce_add_rmsnorm_fp8.register_fake
def _(x, residual, candidate, per_token):
    tokens, hidden = residual.shape
    scale_shape = (tokens, 1) if per_token else ()
    return (
        residual.new_empty((tokens, hidden), dtype=FP8_DTYPE),
        residual.new_empty(scale_shape, dtype=torch.float32),
        torch.empty_like(residual, memory_format=torch.contiguous_format),
    )


@torch.library.custom_op("layer_boundary_flashinfer::finalize_all_reduce_add_rmsnorm", mutates_args=())
def _finalize_all_reduce_add_rmsnorm(
    rows: torch.Tensor, scales: torch.Tensor, shared: Optional[torch.Tensor], residual: torch.Tensor, candidate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    launch = _launcher(candidate, "MoE finalize + all-reduce + add + RMSNorm")
    normed, new_residual = launch(_aligned(rows), _aligned(scales), None if shared is None else _aligned(shared), _aligned(residual))
    inputs = (rows, scales, shared, residual)
    return _fresh(normed, inputs), _fresh(new_residual, inputs)


@_finalize_all_reduce_add_rmsnorm.register_fake
def _(rows, scales, shared, residual, candidate):
    return torch.empty_like(residual, memory_format=torch.contiguous_format), torch.empty_like(
        residual, memory_format=torch.contiguous_format
    )


ALL_REDUCE_ADD_RMSNORM = torch.ops.layer_boundary_flashinfer.all_reduce_add_rmsnorm
ALL_REDUCE_ADD_RMSNORM_FP8 = torch.ops.layer_boundary_flashinfer.all_reduce_add_rmsnorm_fp8
FINALIZE_ALL_REDUCE_ADD_RMSNORM = torch.ops.layer_boundary_flashinfer.finalize_all_reduce_add_rmsnorm
#: every op a fused FlashInfer candidate becomes inside a compiled region
FUSED_OPS = (ALL_REDUCE_ADD_RMSNORM, ALL_REDUCE_ADD_RMSNORM_FP8, FINALIZE_ALL_REDUCE_ADD_RMSNORM)
