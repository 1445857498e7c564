"""Collective and token-row movement primitives, each with its padding and row-order contract.

Row orders:
- attention rows: this rank's attention-DP token set (replicated over attention TP);
- slice rows: this attention-TP rank's contiguous share of the attention rows
  (`split_sizes(num_tokens, attn_tp)`, earlier ranks take the extra row);
- full rows: every DP token set in DP-rank order, each exactly (SUM_LEN) or padded to
  `slot_rows` with zeros (MAX_LEN);
- CP rows: this attention-CP rank's rows of an active CP batch, in the order of its token
  mapping (`Forward.cp`).
"""

from __future__ import annotations

import torch

from ._forward import DpPadding, Forward, RowLayout

__all__ = [
    "dp_gather",
    "dp_scatter",
    "dp_partial_sum",
    "dp_slot",
    "dp_reduce_scatter",
    "take_slice",
    "gather_slices",
    "reduce_scatter_slices",
    "move_input",
    "move_residual",
    "align_rows",
]


def dp_gather(x: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """Attention rows (replicated over attention TP) -> full rows, over the attention-DP group."""
    group = fwd.parallel.groups["attn_dp"]
    if fwd.dp_padding is DpPadding.MAX_LEN:
        padded = x.new_zeros((fwd.slot_rows,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        return group.all_gather(padded)
    return group.all_gatherv(x, fwd.dp_counts)


def dp_scatter(full: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """Full rows -> this rank's attention rows (a view; no communication)."""
    return full[fwd.dp_offset : fwd.dp_offset + fwd.num_tokens]


def dp_slot(x: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """Attention rows -> full rows holding them in this rank's DP slot, zeros elsewhere (no
    communication): a sum of such buffers over the TP group adds the attention-TP partials of
    every slot."""
    buffer = x.new_zeros((fwd.full_rows,) + tuple(x.shape[1:]))
    buffer[fwd.dp_offset : fwd.dp_offset + x.shape[0]] = x
    return buffer


def dp_partial_sum(partial: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """One TP all-reduce that both completes an attention-TP partial sum and gathers over DP
    (each rank's partial in its DP slot, `dp_slot`)."""
    return fwd.parallel.groups["tp"].all_reduce(dp_slot(partial, fwd))


def dp_reduce_scatter(full_partial: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """Full-row partials -> complete attention rows: a TP reduce-scatter (each rank gets its
    attention-TP share of its DP slot), then an all-gather of the shares over attention TP."""
    parallel = fwd.parallel
    share = parallel.groups["tp"].reduce_scatterv(full_partial, fwd.tp_share_sizes)
    attn_tp = parallel.groups["attn_tp"]
    if fwd.dp_padding is DpPadding.MAX_LEN:
        rows = attn_tp.all_gather(share)
        return rows[: fwd.num_tokens]
    return attn_tp.all_gatherv(share, fwd.slice_sizes)


def take_slice(x: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """Attention rows -> this attention-TP rank's slice (a view)."""
    rank = fwd.parallel.attn_tp_rank
    return x[fwd.slice_offset : fwd.slice_offset + fwd.slice_sizes[rank]]


def gather_slices(x: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """Slices -> attention rows, over attention TP."""
    return fwd.parallel.groups["attn_tp"].all_gatherv(x, fwd.slice_sizes)


def reduce_scatter_slices(partial: torch.Tensor, fwd: Forward) -> torch.Tensor:
    """Attention-row partials over attention TP -> this rank's complete slice."""
    return fwd.parallel.groups["attn_tp"].reduce_scatterv(partial, fwd.slice_sizes)


def move_input(inp, move, fwd):
    """Apply an input move to a compute input: a tensor, a tuple of them (a read that prepares
    several inputs, each with the same rows), or an object that moves its own row tensors
    (`map_rows(fn)`: a quantized input's data and per-token scales)."""
    if isinstance(inp, torch.Tensor):
        return move(inp, fwd)
    if isinstance(inp, tuple):
        return tuple(move_input(part, move, fwd) for part in inp)
    map_rows = getattr(inp, "map_rows", None)
    if map_rows is None:
        raise TypeError(
            f"a stage's compute input is {type(inp).__name__}; a read must return a tensor [rows, ...], a tuple of them, "
            "or an object with map_rows(fn) that applies a row move to each of its row tensors"
        )
    return map_rows(lambda t: move(t, fwd))


def move_residual(residual, fn):
    """Apply a row move to a residual that is a tensor or a tuple of row tensors."""
    if isinstance(residual, tuple):
        return tuple(fn(r) for r in residual)
    return fn(residual)


def align_rows(value, rows_from: RowLayout, rows_to: RowLayout, fwd):
    """Move a tensor (or residual tuple) between attention rows and this rank's share of them
    (its attention-TP slice, or its context-parallel rows through `fwd.cp`)."""
    if rows_from is rows_to:
        return value
    if RowLayout.ATTN_CP_LOCAL in (rows_from, rows_to):
        return _align_cp_rows(value, rows_from, rows_to, fwd)
    if rows_to is RowLayout.ATTN_TP_SLICE:
        return move_residual(value, lambda t: take_slice(t, fwd))
    return move_residual(value, lambda t: gather_slices(t, fwd))


def _align_cp_rows(value, rows_from: RowLayout, rows_to: RowLayout, fwd):
    """CP rows <-> attention rows, through the batch's token mapping (`take_local`, `gather`)."""
    mapping = fwd.cp
    if mapping is None:
        raise RuntimeError(
            "rows on a context-parallel partition need the batch's token mapping; build the Forward with cp=..."
        )
    if (rows_from, rows_to) == (RowLayout.DP_LOCAL, RowLayout.ATTN_CP_LOCAL):
        return move_residual(value, mapping.take_local)
    if (rows_from, rows_to) == (RowLayout.ATTN_CP_LOCAL, RowLayout.DP_LOCAL):
        return move_residual(value, mapping.gather)
    raise NotImplementedError(f"no row move from {rows_from.short} to {rows_to.short}")
