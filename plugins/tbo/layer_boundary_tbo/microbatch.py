"""Splitting a batch into two TBO microbatches, and merging them back.

Each attention-DP rank cuts its own attention rows at a token boundary. Every rank knows every
rank's cut (`SplitPlan`), so both microbatches' `dp_counts`, which size their collectives, are
the same on every rank; nothing here communicates to agree on them.

The split completes whatever the batch's last output still owes (a sum, a finalize), because a
partial sum cannot be cut by rows before it is complete; each microbatch then gets its own
stream built from the parts (`Forward.child`), holding the same producer update. The merge
completes both microbatches' owed work and concatenates the rows back in order.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from layer_boundary import Contribution, Messages as CoreMessages, ResidualStream, RowLayout, StreamState
from layer_boundary.plugin import align_rows, move_residual

from .messages import Messages

__all__ = ["SplitPlan", "Microbatch", "SplitStream", "plan_split", "split_batch", "merge_batch"]

ATTENTION_ROWS = RowLayout.DP_LOCAL


class SplitPlan(NamedTuple):
    """Rows of each microbatch on every attention-DP rank (identical on every rank). A named
    tuple: built inside a compiled region, where Dynamo traces it as a tuple."""

    first: tuple
    second: tuple

    @property
    def overlapped(self) -> bool:
        """Both microbatches hold rows somewhere; otherwise the batch runs whole."""
        return sum(self.first) > 0 and sum(self.second) > 0


class Microbatch:
    """One half of a split batch: its Forward (own stream), row range and starting handle."""

    __slots__ = ("index", "forward", "start", "stop", "hidden")

    def __init__(self, index: int, forward, start: int, stop: int, hidden):
        self.index = index
        self.forward = forward
        self.start = start
        self.stop = stop
        self.hidden = hidden

    def __repr__(self) -> str:
        return f"Microbatch({self.index}, rows {self.start}:{self.stop} of this rank)"


class SplitStream:
    """Stands in for the parent batch's stream while its microbatches run: any use raises."""

    __slots__ = ()

    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):  # protocol probes (copy, Dynamo building one): absent
            raise AttributeError(item)
        raise RuntimeError(Messages.PARENT_STREAM)

    def __repr__(self) -> str:
        return "SplitStream()"


def plan_split(forward, split=None) -> SplitPlan:
    """Where each DP rank cuts: `split` (rows of microbatch 0 per DP rank, or an int when there
    is one DP rank), else `forward.extras["tbo_split"]`, else each rank's token midpoint.

    Bad input raises here, before any collective."""
    counts = forward.dp_counts
    if split is None:
        split = forward.extras.get("tbo_split")
    if split is None:
        first = tuple((c + 1) // 2 for c in counts)
    else:
        if isinstance(split, int):
            split = (split,)
        first = tuple(int(s) for s in split)
        if len(first) != len(counts):
            raise ValueError(
                f"the TBO split names {len(first)} attention-DP ranks but the batch has {len(counts)}; give "
                "microbatch 0's rows for every DP rank (the same tuple on every rank)"
            )
        bad = [(d, s, c) for d, (s, c) in enumerate(zip(first, counts)) if not 0 <= s <= c]
        if bad:
            d, s, c = bad[0]
            raise ValueError(f"the TBO split gives DP rank {d} {s} rows for microbatch 0, outside 0..{c} (its token count)")
    return SplitPlan(first=first, second=tuple(c - s for c, s in zip(counts, first)))


def _rows(value, start: int, stop: int):
    return move_residual(value, lambda t: t[start:stop])


def _cat(values):
    if isinstance(values[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*values))
    return torch.cat(values)


def split_batch(hidden, forward, plan: SplitPlan) -> tuple[Microbatch, Microbatch]:
    """Cut the batch's stream and rows into two microbatches; the parent's stream is parked."""
    stream = forward.residual_stream
    if stream is None:
        raise RuntimeError(CoreMessages.NOT_STARTED)
    if isinstance(stream, SplitStream):
        raise RuntimeError("this batch is already split into TBO microbatches; split a microbatch's own Forward instead")
    n, cut = forward.num_tokens, plan.first[forward.parallel.attn_dp_rank]
    bounds = ((0, cut), (cut, n))
    children = (
        forward.child(cut, dp_counts=plan.first, microbatch=0),
        forward.child(n - cut, dp_counts=plan.second, microbatch=1),
    )
    state, contribution, residual = stream.receive(hidden)
    if state is StreamState.INITIAL:  # the stack input: each microbatch enters on its own rows
        parts = [_rows(hidden, a, b) for a, b in bounds]
        for child in children:
            child.residual_stream = ResidualStream()
    else:
        rows = stream.rows
        if contribution is not None:
            contribution.complete()  # a partial sum cannot be cut by rows: complete it first
        if residual is not None:
            residual = align_rows(residual, rows, ATTENTION_ROWS, forward)
        value = None if contribution is None else align_rows(contribution.value, contribution.rows, ATTENTION_ROWS, forward)
        parts = []
        for child, (a, b) in zip(children, bounds):
            child_residual = None if residual is None else align_rows(_rows(residual, a, b), ATTENTION_ROWS, rows, child)
            child_stream = child.residual_stream = ResidualStream()
            if contribution is None:
                child_stream.write(child_residual, rows, handle=child_residual)
                parts.append(child_residual)
            else:
                child_stream.write(child_residual, rows)
                child_value = align_rows(_rows(value, a, b), ATTENTION_ROWS, contribution.rows, child)
                parts.append(child_stream.record(Contribution(child_value, contribution.update, rows=contribution.rows)))
    forward.residual_stream = SplitStream()
    return tuple(Microbatch(i, child, a, b, part) for i, (child, (a, b), part) in enumerate(zip(children, bounds, parts)))


def check_streams(microbatches: Sequence[Microbatch]) -> None:
    """The microbatches' streams are distinct objects (a released stream is None)."""
    first, second = (mb.forward.residual_stream for mb in microbatches)
    if first is not None and first is second:
        raise RuntimeError(Messages.SHARED_STREAM)


def merge_batch(microbatches: Sequence[Microbatch], outputs: Sequence, forward):
    """Complete both microbatches' owed work and rebuild the parent's stream from their rows.

    When both microbatches already left the stack (final norm), their outputs are concatenated
    and the parent's stream is released. Otherwise the microbatches' streams are released once
    their rows are taken (a microbatch Forward holds no stream after the merge). Returns the
    handle to pass on.
    """
    check_streams(microbatches)
    streams = [mb.forward.residual_stream for mb in microbatches]
    released = [s is None for s in streams]
    if all(released):
        forward.residual_stream = None
        return _cat(list(outputs))
    if any(released):
        k = released.index(True)
        raise RuntimeError(
            f"microbatch {k} left the layer stack but microbatch {1 - k} did not; both microbatches run the same stages"
        )
    pending: list[Optional[Contribution]] = []
    residuals, values = [], []
    for mb, stream, out in zip(microbatches, streams, outputs):
        state, contribution, residual = stream.receive(out)
        if state is StreamState.INITIAL:
            raise RuntimeError(f"microbatch {mb.index} ran no stage; its stream is still at the stack input")
        pending.append(contribution)
        if contribution is not None:
            contribution.complete()
            values.append(align_rows(contribution.value, contribution.rows, ATTENTION_ROWS, mb.forward))
        residuals.append(None if residual is None else align_rows(residual, stream.rows, ATTENTION_ROWS, mb.forward))
    for mb in microbatches:  # their rows now belong to the parent: the microbatches hold no stream
        mb.forward.residual_stream = None
    if (pending[0] is None) != (pending[1] is None):
        raise RuntimeError("one TBO microbatch ends with a pending output and the other with a written stream; both must run the same stages")
    rows = streams[0].rows
    parent = ResidualStream()
    residual = None
    if residuals[0] is not None and residuals[1] is not None:
        residual = align_rows(_cat(residuals), ATTENTION_ROWS, rows, forward)
    elif (residuals[0] is None) != (residuals[1] is None):
        raise RuntimeError("one TBO microbatch has a residual and the other none; both must run the same stages")
    if pending[0] is None:
        parent.write(residual, rows, handle=residual)
        handle = residual
    else:
        update = pending[0].update
        if pending[1].update is not update:
            raise RuntimeError("the TBO microbatches hand on different residual updates; both must run the same stages")
        parent.write(residual, rows)
        value = align_rows(_cat(values), ATTENTION_ROWS, pending[0].rows, forward)
        handle = parent.record(Contribution(value, update, rows=pending[0].rows))
    forward.residual_stream = parent
    return handle
