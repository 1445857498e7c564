"""Stack-level helpers on the stream a `Forward` owns: entry, final norm, pipeline transport,
snapshots and extra contributions.

Always keep the value each helper returns and pass exactly that value on.
"""

from __future__ import annotations

import torch

from .._errors import Messages
from .._forward import RowLayout
from .._ops import align_rows
from .._output import HandoffOutput, UnreducedOutput
from .add_norm import NORM_READ, has_add_norm
from .post_norm import post_norm_read
from .stream import ResidualStream, StreamState

ATTENTION_ROWS = RowLayout.DP_LOCAL

__all__ = [
    "start",
    "stream_of",
    "complete_output",
    "fold",
    "written",
    "take_output",
    "norm",
    "to_pp",
    "PP_TRANSPORTS",
    "snapshot",
    "add_to_output",
]


def start(forward) -> ResidualStream:
    """Open a fresh stream for this forward (once, on the embedding path)."""
    stream = ResidualStream()
    forward.residual_stream = stream
    return stream


def stream_of(forward) -> ResidualStream:
    stream = forward.residual_stream
    if stream is None:
        raise RuntimeError(Messages.NOT_STARTED)
    return stream


def complete_output(hidden_states, forward):
    """Finish outstanding communication or finalize work; the residual update stays pending."""
    return stream_of(forward).complete(hidden_states)


def fold(hidden_states, forward):
    """Complete the pending contribution and fold it into the residual (a written stream)."""
    stream = stream_of(forward)
    stream.check(hidden_states)
    pending = stream.pending
    if pending is not None:
        value = align_rows(pending.complete(), pending.rows, stream.rows, forward)
        new_residual = value if stream.residual is None else pending.update.apply(value, stream.residual)
        stream.write(new_residual, stream.rows, handle=new_residual)
    return stream.handle


def written(hidden_states, forward):
    """Replace the stream with a written one whose residual is `hidden_states` (attention rows).

    Discards any pending contribution: call `fold()` first when one may be pending.
    """
    stream = stream_of(forward)
    stream.write(hidden_states, ATTENTION_ROWS, handle=hidden_states)
    return hidden_states


def take_output(hidden_states, forward):
    """Release the stream at a terminal exit whose output is already written."""
    stream = stream_of(forward)
    stream.check(hidden_states)
    if stream.pending is not None:
        raise RuntimeError(Messages.PENDING_AT_TAKE)
    residual = align_rows(stream.residual, stream.rows, ATTENTION_ROWS, forward)
    forward.residual_stream = None
    return residual


def _call(callback, value, owned):
    (callback.capture if hasattr(callback, "capture") and not callable(callback) else callback)(value, owned=owned)


def norm(
    hidden_states,
    forward,
    layernorm,
    *,
    skip_empty: bool = False,
    capture_output=None,
    handoff_norm=None,
    final_read=None,
):
    """Leave the stack: complete what is owed, apply the last update, run the final norm.

    `skip_empty` still completes owed work on an empty batch (other ranks may wait in that
    collective) and skips only the norm. With `handoff_norm`, a finalize handoff goes to
    `handoff_norm.finalize(handoff, residual, gamma)` (fused finalize + sum + add + norm).
    `final_read` is the residual kind's stack-exit read (`ResidualOps.final_read`, a `StageRead`
    that must accept zero rows): a kind whose residual is not one [tokens, hidden] tensor (mHC's
    streams) contracts it there before `layernorm`. Releases the stream.
    """
    stream = stream_of(forward)
    if final_read is None and isinstance(stream.residual, tuple):
        raise ValueError(Messages.FINAL_READ)
    state, contribution, residual = stream.receive(hidden_states)
    forward.residual_stream = None  # the guide: released once it hands on its output (before the norm and any capture run)
    if state is StreamState.INITIAL:
        if final_read is not None:
            normed, new_residual = final_read.read(final_read.enter(hidden_states), layernorm)
        else:
            normed, new_residual = layernorm(hidden_states), hidden_states
    elif state is StreamState.WRITTEN:
        new_residual = residual
        if final_read is not None:
            normed, new_residual = final_read.read(new_residual, layernorm)
        else:
            normed = _maybe_empty(layernorm, new_residual, skip_empty)
    else:
        owed = contribution.owed
        if isinstance(owed, HandoffOutput) and handoff_norm is not None and final_read is None:
            if capture_output is not None:
                raise RuntimeError(
                    "norm(handoff_norm=...) received a finalize handoff, which it fuses; capture_output needs the unfused "
                    "path: drop handoff_norm or capture elsewhere"
                )
            normed, new_residual = handoff_norm.finalize(owed, residual, layernorm.gemma_weight)
        elif _fuses_post_norm(contribution, layernorm, stream, final_read, skip_empty):
            # the terminal output's post-norm, the add and the final norm in one call
            normed, new_residual = final_post_norm_read(contribution.transform.post_norm, layernorm)(contribution.value, residual)
        else:
            value = align_rows(contribution.complete(), contribution.rows, stream.rows, forward)
            update = contribution.update
            if final_read is not None:
                normed, new_residual = final_read.update_and_read(update, value, residual, layernorm)
            elif skip_empty and value.shape[0] == 0:
                new_residual = update.apply(value, residual)
                normed = new_residual
            elif update.plain_add and has_add_norm(layernorm):
                normed, new_residual = layernorm.fused_add_forward(value, residual)
            else:
                new_residual = update.apply(value, residual)
                normed = layernorm(new_residual)
    if stream.rows != ATTENTION_ROWS:  # a share of the rows (slice or CP partition): gather them
        normed = align_rows(normed, stream.rows, ATTENTION_ROWS, forward)
        new_residual = align_rows(new_residual, stream.rows, ATTENTION_ROWS, forward) if capture_output is not None else None
    if capture_output is not None:  # the guide: the final norm's capture is always borrowed
        _call(capture_output, new_residual, False)
    return normed


def _fuses_post_norm(contribution, layernorm, stream, final_read, skip_empty) -> bool:
    """A complete terminal output whose post-norm is still pending (`leaves_post_norm`), on the
    residual's rows, under the plain add, at a core final norm (a skipped empty batch keeps its
    own path)."""
    transform = contribution.transform
    return (
        transform is not None
        and transform.post_norm is not None
        and contribution.owed is None
        and final_read is None
        and contribution.update.plain_add
        and has_add_norm(layernorm)
        and contribution.rows is stream.rows
        and not (skip_empty and contribution.value.shape[0] == 0)
    )


def final_post_norm_read(post_norm, layernorm):
    """The final norm's local completion of an output owing `post_norm` (`PostNormRead`), kept on
    the final norm, one per post-norm, so its kernel is chosen once."""
    return post_norm_read(post_norm, NORM_READ, layernorm)


def _maybe_empty(layernorm, x, skip_empty):
    if skip_empty and x.shape[0] == 0:
        return x
    return layernorm(x)


#: how a pipeline transport moves `to_pp()`'s tensors between attention-TP ranks
PP_TRANSPORTS = ("replicated", "row_slices")


def check_pp_transport(transport: str) -> str:
    if transport not in PP_TRANSPORTS:
        raise ValueError(f"unknown pipeline transport {transport!r}; choose one of {', '.join(PP_TRANSPORTS)}")
    return transport


def to_pp(hidden_states, forward, *, preserve_declared: bool = True, transport: str = "replicated") -> dict:
    """Export the stream for the next pipeline rank and release it.

    Dynamic work (a deferred sum, a finalize) completes here; a statically declared partial sum
    is kept for the receiver's `from_pp()` to complete, unless `preserve_declared=False`.
    Rows travel as attention rows. `owes_declared_sum` (a bool; transport it with the tensors)
    says whether `hidden_states` is still that partial, so the receiver completes the sum
    exactly once even when the sender completed it (`preserve_declared=False`, a terminal or
    completed output) and refuses a partial it would otherwise take as complete.

    `transport` says how the tensors reach the next rank. The default, `"replicated"`, assumes
    every attention-TP rank sends its whole tensors to its peer on the next pipeline rank, so the
    receiver holds this rank's own partial and completes the sum. With `"row_slices"` each
    attention-TP rank sends only its share of the rows and the receiver gathers them: a slice of
    this rank's partial gathered with the other ranks' slices of theirs is no partial of anything,
    so the declared sum completes here and the export owes nothing (`from_pp(...,
    transport="row_slices")` checks that).
    """
    check_pp_transport(transport)
    if transport == "row_slices":
        preserve_declared = False
    stream = stream_of(forward)
    state, contribution, residual = stream.receive(hidden_states)
    if state is StreamState.INITIAL:
        raise RuntimeError(Messages.NOT_STARTED)
    owes = False
    if state is StreamState.WRITTEN:
        out = {"hidden_states": align_rows(residual, stream.rows, ATTENTION_ROWS, forward), "residual": None}
    else:
        update = contribution.update
        if not (update.plain_add or update.at_producer):
            raise NotImplementedError("pipeline boundaries require a plain add or a producer-written residual")
        owed = contribution.owed
        if isinstance(owed, UnreducedOutput) and owed.declared and preserve_declared:
            # the receiver's from_pp() completes the sum and applies the producer's transform
            value, owes = align_rows(owed.partial, contribution.rows, ATTENTION_ROWS, forward), True
        else:
            value = align_rows(contribution.complete(), contribution.rows, ATTENTION_ROWS, forward)
        out = {"hidden_states": value, "residual": align_rows(residual, stream.rows, ATTENTION_ROWS, forward)}
    out["owes_declared_sum"] = owes
    forward.residual_stream = None
    return out


def snapshot(hidden_states, forward) -> torch.Tensor:
    """An owned residual snapshot (residual plus the completed contribution) on attention rows.

    A sum still owed runs on a copy, so the main contribution keeps its pending work.
    """
    stream = stream_of(forward)
    stream.check(hidden_states)
    pending = stream.pending
    if isinstance(stream.residual, tuple) or (pending is not None and not pending.update.plain_add):
        raise NotImplementedError(Messages.SNAPSHOT_PLAIN)
    residual = align_rows(stream.residual, stream.rows, ATTENTION_ROWS, forward)
    if pending is None:
        return residual.clone() if stream.rows == ATTENTION_ROWS else residual
    if isinstance(pending.owed, HandoffOutput):
        raise NotImplementedError("a finalize handoff requires main-output capture")
    if isinstance(pending.owed, UnreducedOutput):
        value = pending.owed.group.all_reduce(pending.owed.partial.clone())
    else:
        value = pending.value
    if pending.transform is not None:
        value = pending.transform(value)
    value = align_rows(value, pending.rows, ATTENTION_ROWS, forward)
    if residual is None:
        return value.clone()
    return pending.update.apply(value, residual)


def add_to_output(hidden_states, forward, extra):
    """Complete the contribution, add `extra` (attention rows) once; the update stays pending."""
    stream = stream_of(forward)
    stream.check(hidden_states)
    pending = stream.pending
    if pending is None:
        new_residual = stream.residual + align_rows(extra, ATTENTION_ROWS, stream.rows, forward)
        stream.write(new_residual, stream.rows, handle=new_residual)
        return new_residual
    value = pending.complete()
    pending.value = value + align_rows(extra, ATTENTION_ROWS, pending.rows, forward)
    stream.handle = pending.value
    return pending.value
