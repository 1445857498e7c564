"""Torch-facing launches of the one-shot all-reduce + residual add + RMSNorm kernels.

`peers` is what a workspace (`layer_boundary_cutedsl.oneshot.OneShotWorkspace`) hands over: this
rank's index, the group size, the staging capacity, this rank's buffer, every rank's buffer as
mapped here (rank order), the local int64 state tensor, the host report words and an optional
CTA cap. Every rank of the group must launch the same number of times with the same row count
(the workspace's callers decide that from facts all ranks share); a rank that does not launch
leaves the others spinning until the timeout traps.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._launch import _raw_stream, address, check_all, check_rows, executor_for, routing_weights
from .allreduce_layout import (
    ENTRY_KINDS, MAX_WORLD, N_ADDRESSES, NORMS_ENTRY_KINDS, NORMS_N_ADDRESSES, AllReduceNormsVariant, AllReduceVariant,
)
from .tiling import MAX_TOP_K

__all__ = ["prepare_allreduce", "allreduce_add_rmsnorm", "moe_finalize_allreduce_add_rmsnorm", "allreduce_add_norms", "grid_for"]

_PROBE = (*range(0x1000, 0x1000 + 16 * N_ADDRESSES, 16), 7, 1, 5, 0.5, 3, 0x5150)
_NORMS_PROBE = (*range(0x1000, 0x1000 + 16 * NORMS_N_ADDRESSES, 16), 7, 1, 5, 0.5, 0.25, 3, 0x5150)
_entries: dict = {}


def _entry(variant: AllReduceVariant, device: torch.device):
    entry = _entries.get((variant, device))
    if entry is None:
        if isinstance(variant, AllReduceNormsVariant):
            entry = executor_for(("allreduce", variant), device, lambda: variant, NORMS_N_ADDRESSES, kinds=NORMS_ENTRY_KINDS,
                                 probe=_NORMS_PROBE)
        else:
            entry = executor_for(("allreduce", variant), device, lambda: variant, N_ADDRESSES, kinds=ENTRY_KINDS, probe=_PROBE)
        _entries[(variant, device)] = entry
    return entry


def prepare_allreduce(variant: AllReduceVariant, device=None) -> None:
    """Compile and load one variant now (before graph capture; at workspace creation)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _entry(variant, device)


def grid_for(rows: int, sms: int, max_ctas: Optional[int]) -> int:
    """A persistent grid: at most one CTA per SM, so every CTA of the launch is resident while
    it waits for its peers (a CTA that waited for a CTA not yet scheduled could deadlock)."""
    grid = min(rows, sms)
    if max_ctas is not None:
        grid = min(grid, max(1, int(max_ctas)))
    return grid


def _launch(variant: AllReduceVariant, peers, rows: int, tensors: list, eps: float, device: torch.device, norms: tuple = ()) -> None:
    """`norms`: the norms variant's extra arguments ((beta, post_gamma) addresses, post_eps)."""
    if rows > peers.capacity:
        raise ValueError(f"{rows} rows do not fit the one-shot workspace ({peers.capacity} rows)")
    entry = _entry(variant, device)
    launcher, sms = entry.launcher, entry.sms
    bases = list(peers.addresses) + [0] * (MAX_WORLD - len(peers.addresses))
    state = peers.state
    addresses = [*tensors, state.data_ptr(), peers.diag_address, peers.buffer, *bases]
    scalars = [rows, peers.rank, peers.capacity, eps]
    if norms:
        extra, post_eps = norms
        addresses += list(extra)
        scalars.append(post_eps)
    grid = grid_for(rows, sms, peers.max_ctas)  # persistent: never more CTAs than SMs, loop or not
    stream = _raw_stream(device.index)
    if torch.cuda.current_device() == device.index:
        launcher(*addresses, *scalars, grid, stream)
    else:
        with torch.cuda.device(device):
            launcher(*addresses, *scalars, grid, stream)


def _outputs(residual, out, residual_out):
    out = torch.empty_like(residual) if out is None else out
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    if out.data_ptr() == residual_out.data_ptr():
        raise ValueError("out and residual_out must not be the same memory")
    return out, residual_out


def allreduce_add_rmsnorm(
    peers, partial: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float, *, weight_offset: float = 0.0, out=None, residual_out=None
):
    """(normed, new_residual): total = sum over the group's ranks (rank order, fp32) of each
    rank's `partial` + `residual`; new_residual = round(total); normed = round(total * rstd *
    (gamma + weight_offset)). All [T, H] of the workspace dtype, rows back to back, 16-byte
    aligned; `out=partial` and `residual_out=residual` are allowed."""
    tokens, hidden = residual.shape
    dtype, device = residual.dtype, residual.device
    out, residual_out = _outputs(residual, out, residual_out)
    shape = residual.shape
    check_rows(dtype, device, shape, partial=partial, residual=residual, out=out, residual_out=residual_out, gamma=gamma)
    if tokens == 0:
        return out, residual_out
    variant = AllReduceVariant(dtype, hidden, peers.world, float(weight_offset))
    tensors = [partial.data_ptr(), 0, 0, residual.data_ptr(), gamma.data_ptr(), residual_out.data_ptr(), out.data_ptr()]
    _launch(variant, peers, tokens, tensors, eps, device)
    return out, residual_out


def moe_finalize_allreduce_add_rmsnorm(peers, rows: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor,
                                       eps: float, *, shared: Optional[torch.Tensor] = None, weight_offset: float = 0.0, out=None,
                                       residual_out=None):
    """The same with this rank's partial = sum_k weights[t, k] * rows[t, k] (+ shared[t]) in fp32,
    rounded once: rows [T, top_k, H] (dense, a core handoff's layout), weights [T, top_k] (used
    in fp32; other dtypes and layouts are converted, a small copy)."""
    tokens, hidden = residual.shape
    dtype, device = residual.dtype, residual.device
    if rows.dim() != 3 or rows.shape[0] != tokens or rows.shape[2] != hidden:
        raise ValueError(f"expert rows must be [{tokens}, top_k, {hidden}], got {tuple(rows.shape)}")
    top_k = rows.shape[1]
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k {top_k} must be in 1..{MAX_TOP_K}")
    if tuple(weights.shape) != (tokens, top_k) or weights.device != device or not weights.is_floating_point():
        raise ValueError(f"weights must be floating point [{tokens}, {top_k}] on {device}, got {weights.dtype} {tuple(weights.shape)}")
    weights = routing_weights(weights)
    out, residual_out = _outputs(residual, out, residual_out)
    check_all((("rows", rows, (tokens, top_k, hidden), dtype, device),))
    check_rows(dtype, device, residual.shape, residual=residual, out=out, residual_out=residual_out, gamma=gamma, shared=shared)
    if tokens == 0:
        return out, residual_out
    variant = AllReduceVariant(dtype, hidden, peers.world, float(weight_offset), top_k=top_k, shared=shared is not None)
    tensors = [address(t) for t in (rows, weights, shared, residual, gamma, residual_out, out)]
    _launch(variant, peers, tokens, tensors, eps, device)
    return out, residual_out



def allreduce_add_norms(peers, partial: torch.Tensor, residual: torch.Tensor, gamma: Optional[torch.Tensor], beta: Optional[torch.Tensor],
                        post_gamma: Optional[torch.Tensor], eps: float, post_eps: float, shape, *, out=None, residual_out=None):
    """(normed, new_residual) of the group's sum of each rank's `partial` with the norms of
    `shape` (a `NormsShape`, kernels/norms.py) around the residual add: with a post-norm the sum
    rounded once, normed, rounded, then added; the read's RMSNorm, LayerNorm or nothing (an
    identity read returns the new residual twice). [T, H] rows of the workspace dtype; gamma,
    beta, post_gamma [H] (None where the shape has none)."""
    tokens, hidden = residual.shape
    dtype, device = residual.dtype, residual.device
    identity = shape.norm == "none"
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    if not identity:
        out = torch.empty_like(residual) if out is None else out
        if out.data_ptr() == residual_out.data_ptr():
            raise ValueError("out and residual_out must not be the same memory")
    weights = dict(gamma=None if identity else gamma, beta=beta if shape.bias else None, post_gamma=post_gamma if shape.post else None)
    missing = [k for k, need in (("gamma", not identity), ("beta", shape.bias), ("post_gamma", shape.post)) if need and weights[k] is None]
    if missing:
        raise ValueError(f"{shape.tag} needs {', '.join(missing)}")
    check_rows(dtype, device, residual.shape, partial=partial, residual=residual, out=out, residual_out=residual_out)
    check_rows(dtype, device, (hidden,), **weights)
    if tokens == 0:
        return (residual_out if identity else out), residual_out
    variant = AllReduceNormsVariant.of(dtype, hidden, peers.world, shape)
    tensors = [partial.data_ptr(), 0, 0, residual.data_ptr(), address(weights["gamma"]), residual_out.data_ptr(), address(out)]
    _launch(variant, peers, tokens, tensors, eps, device, norms=((address(weights["beta"]), address(weights["post_gamma"])), float(post_eps)))
    return (residual_out if identity else out), residual_out
