"""The CuTe DSL kernels as graph nodes: one `torch.library` custom op per kernel call, so that a
chosen fused candidate is one node of a `torch.compile(fullgraph=True)` graph.

A tracer cannot follow a launch (packed pointers through ctypes, a 16-byte alignment test on
`data_ptr()`, a peer-mapped workspace), so inside a compiled region each call becomes its op:

- `oneshot_all_reduce_add_rmsnorm`, `oneshot_finalize_all_reduce_add_rmsnorm`: the one-shot
  fused all-reduce (oneshot.py). The workspace is not a tensor: the op gets its *graph key* (a
  string given when the workspace was created, eagerly) and finds it at run time, as the core's
  collective ops find their groups;
- `moe_finalize`, `moe_finalize_add_rmsnorm`: the local MoE kernels of the three-launch path
  (the add + norm is `local_add_rmsnorm`, local_add_norm.py).

Schemas: the kernels read their inputs and write only new tensors (the normed rows, the new
residual, the finalized partial) and, for the one-shot ops, the workspace's peer buffer and its
state words, reached through the key. No tensor argument is mutated, so `mutates_args=()` is
the truthful declaration; the fake implementations give output shapes and dtypes. Eager calls
launch directly: a custom op's dispatch costs host time on every decode boundary.
"""

from __future__ import annotations

from typing import Optional

import torch

from layer_boundary.plugin import graph_object

__all__ = [
    "ONESHOT_ALL_REDUCE_ADD_RMSNORM", "ONESHOT_FINALIZE_ALL_REDUCE_ADD_RMSNORM", "MOE_FINALIZE", "MOE_FINALIZE_ADD_RMSNORM", "FUSED_OPS",
    "ONESHOT_ALL_REDUCE_ADD_NORMS", "ONESHOT_ALL_REDUCE_POST_ADD", "graph_oneshot_add_norms",
]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as rows the kernels read: contiguous, 16-byte aligned (a copy only when it is not)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _workspace(key: str):
    ws = graph_object(key)
    if ws.released:
        raise RuntimeError(
            f"the one-shot workspace {key!r} was released after this graph was compiled; install the CuTe DSL fusion "
            "again (install_cutedsl_fusion) and compile anew"
        )
    return ws


def _new_rows(like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like, memory_format=torch.contiguous_format)


@torch.library.custom_op("layer_boundary_cutedsl::oneshot_all_reduce_add_rmsnorm", mutates_args=())
def _oneshot_all_reduce_add_rmsnorm(
    partial: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float, weight_offset: float, workspace: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _workspace(workspace).all_reduce_add_rmsnorm(partial, residual, gamma, eps, weight_offset, out=_new_rows(residual),
                                                        residual_out=_new_rows(residual))


@_oneshot_all_reduce_add_rmsnorm.register_fake
def _(partial, residual, gamma, eps, weight_offset, workspace):
    return _new_rows(residual), _new_rows(residual)


@torch.library.custom_op("layer_boundary_cutedsl::oneshot_finalize_all_reduce_add_rmsnorm", mutates_args=())
def _oneshot_finalize_all_reduce_add_rmsnorm(
    rows: torch.Tensor, weights: torch.Tensor, shared: Optional[torch.Tensor], residual: torch.Tensor, gamma: torch.Tensor,
    eps: float, weight_offset: float, workspace: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _workspace(workspace).moe_finalize_all_reduce_add_rmsnorm(
        rows, weights, shared, residual, gamma, eps, weight_offset, out=_new_rows(residual), residual_out=_new_rows(residual)
    )


@_oneshot_finalize_all_reduce_add_rmsnorm.register_fake
def _(rows, weights, shared, residual, gamma, eps, weight_offset, workspace):
    return _new_rows(residual), _new_rows(residual)


@torch.library.custom_op("layer_boundary_cutedsl::moe_finalize", mutates_args=())
def _moe_finalize(rows: torch.Tensor, weights: torch.Tensor, shared: Optional[torch.Tensor]) -> torch.Tensor:
    from .kernels import moe_finalize

    return moe_finalize(_rows(rows), None, weights, shared=None if shared is None else _rows(shared))


@_moe_finalize.register_fake
def _(rows, weights, shared):
    return rows.new_empty((rows.shape[0], rows.shape[2]))


@torch.library.custom_op("layer_boundary_cutedsl::moe_finalize_add_rmsnorm", mutates_args=())
def _moe_finalize_add_rmsnorm(
    rows: torch.Tensor, weights: torch.Tensor, shared: Optional[torch.Tensor], residual: torch.Tensor, gamma: torch.Tensor,
    eps: float, weight_offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .kernels import moe_finalize_add_rmsnorm

    return moe_finalize_add_rmsnorm(_rows(rows), None, weights, _rows(residual), gamma, eps,
                                    shared=None if shared is None else _rows(shared), weight_offset=weight_offset)


@_moe_finalize_add_rmsnorm.register_fake
def _(rows, weights, shared, residual, gamma, eps, weight_offset):
    return _new_rows(residual), _new_rows(residual)


@torch.library.custom_op("layer_boundary_cutedsl::oneshot_all_reduce_add_norms", mutates_args=())
def _oneshot_all_reduce_add_norms(
    partial: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], post_gamma: Optional[torch.Tensor],
    eps: float, post_eps: float, norm: str, weight_offset: float, bias: bool, post: bool, post_offset: float, workspace: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .kernels.norms import NormsShape

    shape = NormsShape(norm, weight_offset, bias, post, post_offset)
    return _workspace(workspace).all_reduce_add_norms(partial, residual, gamma, beta, post_gamma, eps, post_eps, shape,
                                                      out=_new_rows(residual), residual_out=_new_rows(residual))


@_oneshot_all_reduce_add_norms.register_fake
def _(partial, residual, gamma, beta, post_gamma, eps, post_eps, norm, weight_offset, bias, post, post_offset, workspace):
    return _new_rows(residual), _new_rows(residual)


@torch.library.custom_op("layer_boundary_cutedsl::oneshot_all_reduce_post_add", mutates_args=())
def _oneshot_all_reduce_post_add(
    partial: torch.Tensor, residual: torch.Tensor, post_gamma: torch.Tensor, post_eps: float, post_offset: float, workspace: str,
) -> torch.Tensor:
    from .kernels.norms import NormsShape

    shape = NormsShape("none", post=True, post_offset=post_offset)
    return _workspace(workspace).all_reduce_add_norms(partial, residual, None, None, post_gamma, 0.0, post_eps, shape,
                                                      residual_out=_new_rows(residual))[1]


@_oneshot_all_reduce_post_add.register_fake
def _(partial, residual, post_gamma, post_eps, post_offset, workspace):
    return _new_rows(residual)


def graph_oneshot_add_norms(partial, residual, gamma, beta, post_gamma, eps: float, post_eps: float, shape, workspace: str):
    """The one-shot norms launch as one op of a compiled graph (an identity read's op returns the
    new residual once: a custom op's two outputs may not be one tensor)."""
    if shape.norm == "none":
        new_residual = ONESHOT_ALL_REDUCE_POST_ADD(partial, residual, post_gamma, post_eps, float(shape.post_offset), workspace)
        return new_residual, new_residual
    return ONESHOT_ALL_REDUCE_ADD_NORMS(partial, residual, gamma, beta, post_gamma if shape.post else None, eps, post_eps, shape.norm,
                                       float(shape.weight_offset), bool(shape.bias), bool(shape.post), float(shape.post_offset), workspace)


ONESHOT_ALL_REDUCE_ADD_RMSNORM = torch.ops.layer_boundary_cutedsl.oneshot_all_reduce_add_rmsnorm
ONESHOT_ALL_REDUCE_ADD_NORMS = torch.ops.layer_boundary_cutedsl.oneshot_all_reduce_add_norms
ONESHOT_ALL_REDUCE_POST_ADD = torch.ops.layer_boundary_cutedsl.oneshot_all_reduce_post_add
ONESHOT_FINALIZE_ALL_REDUCE_ADD_RMSNORM = torch.ops.layer_boundary_cutedsl.oneshot_finalize_all_reduce_add_rmsnorm
MOE_FINALIZE = torch.ops.layer_boundary_cutedsl.moe_finalize
MOE_FINALIZE_ADD_RMSNORM = torch.ops.layer_boundary_cutedsl.moe_finalize_add_rmsnorm
#: every op a CuTe DSL kernel call becomes inside a compiled region (with local_add_rmsnorm and the local norms ops)
FUSED_OPS = (ONESHOT_ALL_REDUCE_ADD_RMSNORM, ONESHOT_FINALIZE_ALL_REDUCE_ADD_RMSNORM, MOE_FINALIZE, MOE_FINALIZE_ADD_RMSNORM,
             ONESHOT_ALL_REDUCE_ADD_NORMS, ONESHOT_ALL_REDUCE_POST_ADD)
