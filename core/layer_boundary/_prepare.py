"""Executing a bound entry path: complete what is owed, apply the producer's update, read,
and move the input, in the order the plan chose.
"""

from __future__ import annotations

import torch

from . import _debug as debug
from ._checks import check_rows
from ._errors import Messages
from ._forward import RowLayout
from ._fusions import run_candidates
from ._ops import align_rows, dp_partial_sum, dp_scatter, move_input, reduce_scatter_slices
from ._output import HandoffOutput, UnreducedOutput
from ._paths import EntryMode, Owed
from ._residual.stream import CARRIED, StreamState

__all__ = ["run_entry", "run_local", "run_parallel"]

ATTENTION_ROWS = RowLayout.DP_LOCAL
SLICE_ROWS = RowLayout.ATTN_TP_SLICE


def _capture(callback, value, owned: bool) -> None:
    if callback is not None:
        (callback.capture if hasattr(callback, "capture") and not callable(callback) else callback)(value, owned=owned)


def run_local(plan, entry, hidden, fwd):
    """The common entry, kept lean: a pending contribution on attention rows, no capture.

    Anything unusual (no stream, a written stream, a foreign handle, a capability mismatch)
    goes to `run_entry`, which raises the precise error or takes the general path.
    """
    stream = fwd.residual_stream
    pending = None if stream is None else stream.pending
    if (
        pending is None
        or hidden is not stream.handle
        or pending.update.plain_add != entry.arrives_plain
        or stream.residual is None
        or (pending.owed is not None and owed_mismatch(entry, pending.owed))
    ):
        return run_entry(plan, entry, hidden, fwd)
    stream.pending = stream.handle = None
    owed = pending.owed
    norm = plan.norm
    transform = pending.transform
    if transform is None:
        if owed is None:
            if entry.add_norm is not None:  # plain add + plain RMSNorm read, bound at construction
                inp, residual = entry.add_norm(pending.value, stream.residual)
            else:
                inp, residual = plan.read.update_and_read(pending.update, pending.value, stream.residual, norm)
        elif entry.candidates and entry.post_transform is None:  # (a post-norm entry's candidates apply the norm)
            inp, residual = run_candidates(entry.candidates, owed, stream.residual, fwd, isinstance(owed, HandoffOutput))
        else:
            inp, residual = plan.read.update_and_read(pending.update, pending.complete(), stream.residual, norm)
    elif transform is entry.post_transform:  # the producer's post-norm, completed here with the add and the read
        if owed is None:
            inp, residual = entry.read_complete(pending.value, stream.residual)
        else:
            inp, residual = run_candidates(entry.candidates, owed, stream.residual, fwd, isinstance(owed, HandoffOutput))
    else:
        inp, residual = plan.read.update_and_read(pending.update, pending.complete(), stream.residual, norm)
    pending.owed = pending.value = None  # consumed: the caller's handle retains nothing
    stream.residual = residual
    stream.rows = entry.residual_rows
    move = entry.input_move
    return inp if move is None else move_input(inp, move, fwd)


def run_entry(plan, entry, hidden, fwd, capture_output=None, captured=None, post_addition=None):
    stream = fwd.residual_stream
    if stream is None:
        raise RuntimeError(Messages.NOT_STARTED)
    read = plan.read
    norm = plan.norm
    if post_addition is not None:
        _check_post_addition(plan, stream, post_addition)
    state, contribution, residual = stream.receive(hidden)
    if post_addition is not None and state is not StreamState.INITIAL:
        return _post_addition_entry(plan, entry, contribution, residual, stream, post_addition, fwd, capture_output, captured)
    if state is StreamState.INITIAL:
        if post_addition is not None:
            raise ValueError(
                f"stage {plan.label}: post_residual_addition is added to the residual after the producer's update, but the "
                "stream is at the stack input (no residual yet); add it to the stack input instead"
            )
        if not plan.enters_stack:
            raise RuntimeError(
                f"stage {plan.label} has a producer (previous=...) but the residual stream is empty; call "
                "residual_batch.start() once, before the first layer, in the segment that runs it"
            )
        if debug.DEBUG:
            debug.check_batch_facts(fwd)
        check_rows(plan, hidden, fwd.num_tokens, fwd, "stack input")
        _capture(capture_output, hidden, owned=False)
        h = align_rows(hidden, ATTENTION_ROWS, entry.residual_rows, fwd)
        inp, residual = read.read(read.enter(h), norm)
        stream.write(residual, entry.residual_rows)
        return _finish_entry(plan, entry, inp, residual, fwd, captured, owned=False)
    if state is StreamState.WRITTEN:
        residual = align_rows(residual, stream.rows, entry.residual_rows, fwd)
        if capture_output is not None:
            _capture(capture_output, _to_producer_rows(residual, entry, fwd), owned=entry.capture_allocates)
        inp, residual = read.read(residual, norm)
        stream.write(residual, entry.residual_rows)
        return _finish_entry(plan, entry, inp, residual, fwd, captured, owned=False)

    if entry.arrives_plain is not None and contribution.update.plain_add != entry.arrives_plain:
        raise RuntimeError(
            f"producer update does not match the boundary's capability at stage {plan.label}: "
            f"{contribution.update!r} arrived where plain_add={entry.arrives_plain} was declared by previous="
        )
    if contribution.owed is not None and owed_mismatch(entry, contribution.owed):
        _raise_owed(plan, entry, contribution)
    if capture_output is not None:
        contribution.complete()  # a capture completes the main output unfused
    mode = entry.mode
    owed = contribution.owed
    if mode is EntryMode.DP_PARTIAL and isinstance(owed, UnreducedOutput) and owed.declared and contribution.transform is None:
        partial = owed.partial
        if fwd.parallel.attn_tp_rank == 0:
            partial = partial + residual
        full = dp_partial_sum(partial, fwd)
        contribution.owed = None  # consumed
        residual = dp_scatter(full, fwd)
        stream.write(residual, ATTENTION_ROWS)
        # the sum already sits on the gathered rows: the read runs there, no further move
        return _finish_entry(plan, entry, norm(full), residual, fwd, captured, owned=False, skip_move=True)
    if mode is EntryMode.SCATTER:
        if isinstance(owed, UnreducedOutput) and contribution.rows is ATTENTION_ROWS:
            value = reduce_scatter_slices(owed.partial, fwd)
            contribution.owed = None
            if contribution.transform is not None:
                value = contribution.transform(value)
                contribution.transform = None
        else:
            value = align_rows(contribution.complete(), contribution.rows, SLICE_ROWS, fwd)
        residual = align_rows(residual, stream.rows, SLICE_ROWS, fwd)
        inp, residual = read.update_and_read(contribution.update, value, residual, norm)
        contribution.owed = contribution.value = None  # consumed
        stream.write(residual, SLICE_ROWS)
        if capture_output is not None:
            _capture(capture_output, _to_producer_rows(residual, entry, fwd), owned=True)
        return _finish_entry(plan, entry, inp, residual, fwd, captured, owned=False)
    if mode is EntryMode.BRANCH:  # pragma: no cover - dispatched by StageBoundary
        raise AssertionError(mode)
    # LOCAL and ENTER (and DP_PARTIAL when the sum arrived complete)
    transform = contribution.transform
    post = transform is not None and transform is entry.post_transform  # the producer's post-norm, completed here
    if owed is not None and entry.candidates and ((transform is None and entry.post_transform is None) or post):
        inp, residual = run_candidates(entry.candidates, owed, residual, fwd, isinstance(owed, HandoffOutput))
    elif owed is None and post:
        inp, residual = entry.read_complete(contribution.value, residual)
    else:
        value = contribution.complete()
        inp, residual = read.update_and_read(contribution.update, value, residual, norm)
    contribution.owed = contribution.value = None  # consumed: the caller's handle retains nothing
    stream.write(residual, entry.residual_rows)
    if entry.residual_rows is ATTENTION_ROWS:
        _capture(capture_output, residual, owned=plan.capture_owned)
        return _finish_entry(plan, entry, inp, residual, fwd, captured, owned=plan.capture_owned)
    if capture_output is not None:  # residual on a share of the rows: the capture gathers (allocates)
        _capture(capture_output, _to_producer_rows(residual, entry, fwd), owned=True)
    return _finish_entry(plan, entry, inp, residual, fwd, captured, owned=False)


def run_parallel(plan, entry, hidden, fwd):
    """A parallel-residual FFN's input (`EntryMode.PARALLEL`): its norm of the residual the
    attention before it read. The attention's output stays pending, held for this stage's exit
    (the stream's handle becomes `CARRIED`, so no other call can take it); nothing completes here."""
    stream = fwd.residual_stream
    if stream is None:
        raise RuntimeError(Messages.NOT_STARTED)
    pending = stream.pending
    if pending is None:
        raise RuntimeError(
            f"stage {plan.label}: a parallel-residual FFN reads the residual its attention read and takes that attention's "
            "output to its exit, but no attention output is pending (residual_batch.fold() or written() applied it, or the "
            "stack starts here); pass the attention's finish() handle straight to this prepare()"
        )
    stream.check(hidden)
    if not pending.update.plain_add:
        raise RuntimeError(
            f"producer update does not match the boundary's capability at stage {plan.label}: {pending.update!r} arrived where "
            "plain_add=True was declared by previous="
        )
    if pending.owed is not None and owed_mismatch(entry, pending.owed):
        _raise_owed(plan, entry, pending)
    if pending.transform is not None:
        raise RuntimeError(
            f"stage {plan.label}: the arriving output has an output transform ({pending.transform!r}), which a parallel "
            "residual cannot join into one sum, but previous= declares none; describe the real producer"
        )
    residual = align_rows(stream.residual, stream.rows, entry.residual_rows, fwd)
    inp, _ = plan.read.read(residual, plan.norm)  # a norm read: the residual stays as it is
    stream.handle = CARRIED
    move = entry.input_move
    return inp if move is None else move_input(inp, move, fwd)


def _check_post_addition(plan, stream, extra) -> None:
    """Before anything runs: the addition needs a plain tensor residual and a plain update."""
    pending = stream.pending
    if isinstance(stream.residual, tuple) or (pending is not None and not pending.update.plain_add):
        raise NotImplementedError(
            f"stage {plan.label}: post_residual_addition needs a plain residual update (a tensor residual the addition "
            "joins); this residual kind does not support it"
        )
    if not isinstance(extra, torch.Tensor):
        raise TypeError(f"stage {plan.label}: post_residual_addition must be a tensor on attention rows, got {type(extra).__name__}")


def _post_addition_entry(plan, entry, contribution, residual, stream, extra, fwd, capture_output, captured):
    """The general entry with a post-residual addition: the output completes unfused, the update
    runs, the capture takes output plus residual, then the addition joins it before the read."""
    rows = entry.residual_rows
    residual = align_rows(residual, stream.rows, rows, fwd)
    if contribution is not None:
        if contribution.owed is not None and owed_mismatch(entry, contribution.owed):
            _raise_owed(plan, entry, contribution)
        value = align_rows(contribution.complete(), contribution.rows, rows, fwd)
        residual = contribution.update.apply(value, residual)
        contribution.owed = contribution.value = None  # consumed
    if capture_output is not None:  # a sum computed here, which nothing writes: owned
        _capture(capture_output, _to_producer_rows(residual, entry, fwd), owned=contribution is not None or rows is not ATTENTION_ROWS)
    inp, residual = plan.read.read(residual + align_rows(extra, ATTENTION_ROWS, rows, fwd), plan.norm)
    stream.write(residual, rows)
    return _finish_entry(plan, entry, inp, residual, fwd, captured, owned=False)


def _raise_owed(plan, entry, contribution):
    expected = "nothing owed" if entry.owed is Owed.NOTHING else f"a sum over {_names(entry.owed_groups)}"
    source = plan.declaration.previous
    raise RuntimeError(
        f"stage {plan.label}: the arriving output still owes {contribution.describe()}, but previous="
        f"{source.describe() if source is not None else None} declares {expected} here; a consumer completes only "
        "what its previous= declaration leaves: describe the real producer"
    )


def owed_mismatch(entry, owed) -> bool:
    """An owed output this entry's contract does not expect: anything where nothing may be
    owed, or a sum over other ranks than the declared one (a handoff without a sum group is
    the producer's own business; a path a plugin built without `owed_groups` checks no group)."""
    if entry.owed is Owed.NOTHING:
        return True
    groups = entry.owed_groups
    sum_group = owed.sum_group
    return bool(groups) and sum_group is not None and sum_group not in groups


def _names(groups) -> str:
    return " / ".join(sorted(g.name for g in groups))


def _to_producer_rows(residual, entry, fwd):
    """The residual on the producer's (attention) rows; a collective on slices, so only for a capture."""
    return align_rows(residual, entry.residual_rows, ATTENTION_ROWS, fwd)


def _finish_entry(plan, entry, inp, residual, fwd, captured, *, owned, skip_move=False):
    if captured is not None:
        if entry.residual_rows is not ATTENTION_ROWS and entry.input_move is not None:
            # the compute input moves to attention rows: capture the residual on those rows
            _capture(captured, align_rows(residual, entry.residual_rows, ATTENTION_ROWS, fwd), owned=True)
        else:
            _capture(captured, residual, owned=owned)
    if entry.input_move is not None and not skip_move:
        inp = move_input(inp, entry.input_move, fwd)
    return inp
