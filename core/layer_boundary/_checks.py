"""Bad input caught where it enters, before any collective: a wrong row count, hidden size,
dtype or device from compute (or at stack entry) is a clear error on the rank that made it,
instead of a collective with mismatched shapes (a hang or a crash on the other ranks) or a
silently broadcast or promoted sum.
"""

from __future__ import annotations

import operator

import torch

__all__ = ["check_rows", "norm_hidden_size"]


def norm_hidden_size(norm, stage: str) -> int:
    """The hidden size `stage`'s norm reads, which every compute output is checked against: the
    norm's `hidden_size`, else its one-dimensional `normalized_shape` (torch's LayerNorm and
    RMSNorm, with or without a weight), else the length of its 1-D `weight`. Any other norm is
    refused here, at construction, naming the fix."""
    size = getattr(norm, "hidden_size", None)
    if size is not None and not isinstance(size, bool):
        try:
            size = operator.index(size)  # an int, or an integer type of another library
        except TypeError:
            size = None
        if size is not None and size > 0:
            return size
    name = type(norm).__name__
    shape = getattr(norm, "normalized_shape", None)
    if shape is not None:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if len(shape) == 1:
            return int(shape[0])
        raise ValueError(
            f"stage {stage}: its norm {name} normalizes over {list(shape)}, but a stage's norm reads rows of one hidden "
            "size; build it over the last dimension only (normalized_shape=hidden_size)"
        )
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return int(weight.shape[0])
    raise ValueError(
        f"stage {stage}: cannot tell the hidden size of its norm ({name}): give the module a `hidden_size` attribute "
        "(or a 1-D `weight` or `normalized_shape`), so compute outputs are checked before any collective; a read "
        "that normalizes nothing still takes a module that names the hidden size"
    )


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
