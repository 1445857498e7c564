"""Bad input caught where it enters, before any collective: a wrong row count, hidden size,
dtype or device from compute (or at stack entry) is a clear error on the rank that made it,
instead of a collective with mismatched shapes (a hang or a crash on the other ranks) or a
silently broadcast or promoted sum.
"""

from __future__ import annotations

import torch

__all__ = ["check_rows", "expected_hidden"]


def expected_hidden(norm):
    return getattr(norm, "hidden_size", None)


def check_rows(plan, value, rows: int, fwd, what: str) -> None:
    """`value` (compute output or stack input) must be [rows, hidden] in the residual's dtype
    and on its device. One combined test on the common path; details only on failure."""
    if not isinstance(value, torch.Tensor):
        return
    shape = value.shape
    hidden = plan.hidden_size
    stream = fwd.residual_stream
    residual = None if stream is None else stream.residual
    if (
        # one tuple comparison for the common [rows, hidden]; more dimensions or no known hidden
        # size take the spelled-out test
        (shape == (rows, hidden) or (len(shape) >= 2 and shape[0] == rows and (hidden is None or shape[-1] == hidden)))
        and (
            not isinstance(residual, torch.Tensor)
            or (
                value.dtype == residual.dtype
                # torch.device objects are built per access: compare them only off the CPU
                and ((value.is_cpu and residual.is_cpu) or value.device == residual.device)
            )
        )
    ):
        return
    _explain(plan, value, rows, fwd, what, residual)


def _explain(plan, value, rows, fwd, what, residual) -> None:
    if value.dim() < 2 or value.shape[0] != rows:
        raise ValueError(
            f"stage {plan.label}: {what} has shape {tuple(value.shape)}, expected {rows} rows "
            f"({fwd.variant.value} batch, {fwd.num_tokens} tokens on this rank); compute returns one row per input row"
        )
    hidden = plan.hidden_size
    if hidden is not None and value.shape[-1] != hidden:
        raise ValueError(
            f"stage {plan.label}: {what} has hidden size {value.shape[-1]}, but the stage's norm has {hidden}"
        )
    if value.dtype != residual.dtype:
        raise ValueError(
            f"stage {plan.label}: {what} is {value.dtype} but the residual is {residual.dtype}; "
            "cast compute outputs to the residual's dtype"
        )
    raise ValueError(f"stage {plan.label}: {what} is on {value.device} but the residual is on {residual.device}")
