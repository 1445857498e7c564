"""The producer side: decide once per batch how a stage's output completes, publish the flags
compute needs, and apply exactly the completion that matches them.

A decision is made when the exit scope opens and never revisited after compute: the flags
(`fuse_mlp_allreduce`, `mlp_reduce_scatter`, `defer_moe_finalize`) and the completion action
come from the same decision, so no skip flag is ever set without its completion.
"""

from __future__ import annotations

import torch

from ._checks import check_rows
from ._errors import Messages
from ._forward import _SCOPE, ComputeFlags, RowLayout
from ._fusions import FusionError
from ._ops import align_rows, dp_slot
from ._output import HandoffOutput, UnreducedOutput
from ._residual.stream import CARRIED, REPLACED_PENDING, Contribution

__all__ = [
    "FfnExit",
    "MixerExit",
    "ExitDecision",
    "COMPLETE_NOW",
    "record_complete",
    "record_attention",
    "record_lean",
    "complete_reduced",
    "plain_ffn_exit",
    "PlainFfnExit",
    "ParallelFfnExit",
    "join_reduced",
    "NO_SKIP",
]

_Tensor = torch.Tensor


class ExitDecision:
    __slots__ = ("flags", "defer_sum", "reduce_scatter", "declared")

    def __init__(self, flags: ComputeFlags, *, defer_sum=False, reduce_scatter=False, declared=False):
        self.flags = flags
        self.defer_sum = defer_sum
        self.reduce_scatter = reduce_scatter
        self.declared = declared

    def __repr__(self) -> str:
        return f"ExitDecision({self.flags}, defer_sum={self.defer_sum}, reduce_scatter={self.reduce_scatter}, declared={self.declared})"


#: the flags of an exit that lets compute reduce: equal to the defaults, but a distinct object so
#: that an open exit scope stays detectable (`exit_scope_open()`, checked at TBO switch points)
_NO_SKIP = NO_SKIP = ComputeFlags()


#: the decision of an exit that can only let compute reduce: shared, never mutated
COMPLETE_NOW = ExitDecision(_NO_SKIP)
#: a mixer's decision to leave its declared sum to the next input: shared, never mutated
_LEAVE_DECLARED = ExitDecision(ComputeFlags(fuse_mlp_allreduce=True), declared=True)
#: every other decision an exit can take, shared likewise: a per-batch choice selects one of these
#: values (nothing is built per forward, and a compiled region sees constants)
_DEFERRALS = {
    (True, False): ExitDecision(ComputeFlags(fuse_mlp_allreduce=True), defer_sum=True),
    (False, True): ExitDecision(ComputeFlags(defer_moe_finalize=True)),
    (True, True): ExitDecision(ComputeFlags(fuse_mlp_allreduce=True, defer_moe_finalize=True), defer_sum=True),
}
_DEFER_SUM = _DEFERRALS[(True, False)]
#: the reduce-scatter decision, by whether this rank owns a LOCAL_TAIL component (TP rank 0)
_SCATTERS = {
    owns: ExitDecision(ComputeFlags(mlp_reduce_scatter=True, owns_local_tail=owns), reduce_scatter=True) for owns in (True, False)
}
#: a parallel-residual FFN's decision to complete its joined sum at the exit: compute still leaves
#: its sum, which the boundary runs once the attention's output has joined it
_JOIN_NOW = ExitDecision(ComputeFlags(fuse_mlp_allreduce=True))


def _stream(fwd):
    stream = fwd.residual_stream
    if stream is None:
        raise RuntimeError(Messages.NOT_STARTED)
    return stream


def record_complete(plan, ex, value, fwd, transform=None):
    """Record a complete contribution on the exit's output rows (its post-norm `transform` still
    pending, where the exit keeps it for the next input); an update that runs at the exit
    (`ex.writes_at_exit`) writes the stream now, on the residual's rows."""
    stream = _stream(fwd)
    update = plan.declaration.update
    if ex.writes_at_exit:
        residual = stream.residual
        value = align_rows(value, ex.output_rows, stream.rows, fwd)
        new_residual = value if residual is None else update.apply(value, residual)
        stream.write(new_residual, stream.rows, handle=new_residual)
        return new_residual
    return stream.record(Contribution(value, update, transform=transform, rows=ex.output_rows))


_DP_LOCAL = RowLayout.DP_LOCAL


def record_lean(stream, output, forward, ex, hidden_size: int, update) -> bool:
    """The lean finishes' common case (`PlainFfnExit.finish`, one-rank attention
    `StageBoundary.finish`): an output that `check_rows` would pass — [rows, hidden] in the
    residual's dtype (dtypes are singletons) on its device — becomes the stream's complete
    pending contribution, refilling the spare the last lean input left; the handle is the
    tensor itself. False (nothing recorded): the caller's general path checks and raises."""
    residual = stream.residual
    layout = ex.compute_rows
    rows = forward.num_tokens if layout is _DP_LOCAL else layout.rows(forward)
    if not (
        type(residual) is _Tensor
        and output.shape == (rows, hidden_size)
        and output.dtype is residual.dtype
        and ((output.is_cpu and residual.is_cpu) or output.device == residual.device)
    ):
        return False
    contribution = stream.spare
    if contribution is None:  # positional arguments: a keyword call costs more
        stream.pending = Contribution(output, update, None, None, ex.output_rows)
    else:  # the complete contribution the last input consumed, refilled
        stream.spare = None
        contribution.value = output
        contribution.update = update
        contribution.rows = ex.output_rows
        stream.pending = contribution
    stream.handle = output
    return True


def compute_rows(ex, fwd) -> int:
    """The rows compute returns on this rank for exit `ex`."""
    layout = ex.compute_rows
    return fwd.num_tokens if layout is _DP_LOCAL else layout.rows(fwd)


def record_attention(plan, out, fwd, ex):
    """A PARTIAL attention output: its attention-TP sum is always left to the next input."""
    layout = ex.compute_rows  # inlined compute_rows(): the common case reads one attribute
    check_rows(plan, out, fwd.num_tokens if layout is _DP_LOCAL else layout.rows(fwd), fwd, "attention output")
    if ex.writes_at_exit:  # the update runs here: complete the sum now instead of leaving it
        return complete_reduced(plan, ex, out if ex.group.size == 1 else ex.group.all_reduce(out), fwd)
    return _leave_sum(plan, ex, out, fwd, declared=True)


def _leave_sum(plan, ex, out, fwd, *, declared: bool):
    """Record an output whose sum over `ex.group` is left to the next input, on the exit's
    output rows (complete at once when the group has one rank: nothing is owed then)."""
    decl = plan.declaration
    stream = _stream(fwd)
    move = ex.output_move
    if move is not None:
        out = move(out, fwd)  # taking rows commutes with the sum: the next input reduces fewer rows
    if ex.group.size == 1:
        transform = decl.output_transform
        if transform is None or ex.keeps_post_norm:  # a post-norm waits for the next input
            return stream.record(Contribution(out, decl.update, transform=transform, rows=ex.output_rows))
        return stream.record(Contribution(transform(out), decl.update, rows=ex.output_rows))
    owed = UnreducedOutput(out, ex.group, ex.sum_group, declared=declared)
    return stream.record(Contribution(None, decl.update, owed=owed, transform=decl.output_transform, rows=ex.output_rows))


def complete_reduced(plan, ex, out, fwd):
    """Output that compute already reduced: transform (unless the exit keeps a post-norm for the
    next input), move to the exit's output rows, record."""
    transform = plan.declaration.output_transform
    pending = None
    if transform is not None:
        if ex.keeps_post_norm:
            pending = transform
        else:
            out = transform(out)
    move = ex.output_move
    if move is not None:
        out = move(out, fwd)
    return record_complete(plan, ex, out, fwd, pending)


#: a second finish() on one exit scope
FINISHED_TWICE = "finish() was already called for this exit; open a new exit for the next forward"


class _ExitScope:
    """`flags` is the decision's flags, stored on the scope so that entering reads one slot."""

    __slots__ = ("plan", "path", "fwd", "decision", "flags", "_previous", "_finished")

    def __init__(self, plan, path, fwd, decision: ExitDecision):
        self.plan = plan
        self.path = path
        self.fwd = fwd
        self.decision = decision
        self.flags = decision.flags
        self._previous = None
        self._finished = False

    @property
    def fuse_mlp_allreduce(self) -> bool:
        return self.flags.fuse_mlp_allreduce

    @property
    def mlp_reduce_scatter(self) -> bool:
        return self.flags.mlp_reduce_scatter

    @property
    def defer_moe_finalize(self) -> bool:
        return self.flags.defer_moe_finalize

    def __enter__(self):
        if self._previous is not None:
            raise RuntimeError("an exit scope is entered once; open a new one with boundary.exit(forward)")
        self._previous = _SCOPE.flags  # the flags in force before: restored on exit
        _SCOPE.flags = self.flags
        return self

    def __exit__(self, exc_type, exc, traceback):
        _SCOPE.flags = self._previous
        return False

    def _begin_finish(self):
        if self._finished:
            raise RuntimeError(FINISHED_TWICE)
        self._finished = True


class FfnExit(_ExitScope):
    """An FFN's exit scope; `finish(output)` applies the decided completion once."""

    __slots__ = ()

    @classmethod
    def open(cls, plan, fwd) -> "FfnExit":
        path = plan.path_for(fwd)
        if fwd.residual_stream is None:
            raise RuntimeError(Messages.NOT_STARTED)
        ex = path.exit
        if ex.static_decision is not None:
            return cls(plan, path, fwd, ex.static_decision)
        defer_finalize = ex.asks_finalize and _finalize_deferred(plan, ex, fwd)
        scatter = ex.scatter
        if scatter is not None:
            return cls(plan, path, fwd, _scatter_decision(fwd, scatter.eligible(fwd)))
        defer = ex.may_defer and fwd.num_tokens > 0
        if defer and plan.fused_consumer_only:
            defer = any(p.can_defer_all_reduce(plan, fwd) for p in plan.all_reduce_providers)
        if defer or defer_finalize:
            return cls(plan, path, fwd, _DEFERRALS[(defer, defer_finalize)])
        return cls(plan, path, fwd, COMPLETE_NOW)

    def finish(self, out):
        if self._finished:  # `_begin_finish`, inlined
            raise RuntimeError(FINISHED_TWICE)
        self._finished = True
        plan, path, fwd, decision = self.plan, self.path, self.fwd, self.decision
        if type(out) is torch.Tensor:
            ex = path.exit
            layout = ex.compute_rows
            rows = fwd.num_tokens if layout is _DP_LOCAL else layout.rows(fwd)
            stream = fwd.residual_stream
            residual = None if stream is None else stream.residual
            # `check_rows`'s common case, inlined (as in `StageBoundary.finish`); anything else
            # gets the full test and its errors
            if not (
                type(residual) is torch.Tensor
                and out.shape == (rows, plan.hidden_size)
                and out.dtype == residual.dtype
                and ((out.is_cpu and residual.is_cpu) or out.device == residual.device)
            ):
                check_rows(plan, out, rows, fwd, "FFN output")
            if decision is COMPLETE_NOW:
                decl = plan.declaration
                if decl.output_transform is None and ex.output_move is None and not ex.writes_at_exit:
                    # `complete_reduced` with nothing to transform, move or write, inlined
                    if stream is None:
                        raise RuntimeError(Messages.NOT_STARTED)
                    if stream.pending is not None:
                        raise RuntimeError(REPLACED_PENDING)
                    stream.pending = Contribution(out, decl.update, rows=ex.output_rows)
                    stream.handle = out  # complete: the handle is the tensor itself
                    return out
                return complete_reduced(plan, ex, out, fwd)
        stream = _stream(fwd)
        decl = plan.declaration
        if isinstance(out, HandoffOutput):
            if not decision.flags.defer_moe_finalize:
                raise RuntimeError(
                    f"stage {plan.label} returned a HandoffOutput but its exit did not publish defer_moe_finalize; "
                    "finalize inside the MoE unless get_forward().defer_moe_finalize is set"
                )
            return stream.record(Contribution(None, decl.update, owed=out, transform=decl.output_transform))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {plan.label}: compute must return a tensor or a HandoffOutput, got {type(out).__name__}")
        if decision.defer_sum:  # the sum (and a post-norm, the only transform that defers) waits for the next input
            owed = UnreducedOutput(out, path.exit.group, path.exit.sum_group, declared=False)
            return stream.record(Contribution(None, decl.update, owed=owed, transform=decl.output_transform))
        if decision.reduce_scatter:
            transform = decl.output_transform
            if transform is not None:
                out = transform(out)  # allowed only when declared before_reduce_scatter
            ex = path.exit
            return record_complete(plan, ex, ex.scatter.run(out, fwd, ex.group), fwd)
        return complete_reduced(plan, path.exit, out, fwd)


def plain_ffn_exit(plan, path) -> bool:
    """Whether an FFN path's exit is plain: its decision is static (`COMPLETE_NOW`) and its
    output is recorded as it is (no output transform, row move or exit-time write)."""
    ex = path.exit
    return (
        ex.static_decision is COMPLETE_NOW
        and plan.declaration.output_transform is None
        and ex.output_move is None
        and not ex.writes_at_exit
    )


class PlainFfnExit(FfnExit):
    """A plain FFN exit (`plain_ffn_exit`): `finish()` records a well-formed output in one step;
    anything else (a second finish, a malformed output, no stream, a pending contribution) takes
    `FfnExit.finish`, which raises its errors.

    `StageBoundary.exit` builds it with `COMPLETE_NOW`."""

    __slots__ = ()

    def finish(self, out):
        fwd = self.fwd
        stream = fwd.residual_stream
        if type(out) is _Tensor and stream is not None and stream.pending is None and not self._finished:
            if record_lean(stream, out, fwd, self.path.exit, self.plan.hidden_size, self.plan.declaration.update):
                self._finished = True
                return out
        return FfnExit.finish(self, out)


def _finalize_deferred(plan, ex, fwd) -> bool:
    """Ask the stage's finalize providers (the guide: on every FFN exit that has one). Where
    the core cannot take a handoff (rows move at this exit, the batch has no tokens, the update
    runs at the exit) each must decline, identically on every rank."""
    accepted = next((p for p in plan.finalize_providers if p.can_defer_finalize(plan, fwd)), None)
    if accepted is None:
        return False
    if not ex.handoff_ok or fwd.num_tokens == 0:
        raise FusionError(
            f"stage {plan.label}: {type(accepted).__name__}.can_defer_finalize accepted a finalize handoff where the exit "
            f"cannot leave one ({fwd.variant.name} batch, {fwd.num_tokens} tokens on this rank, topology "
            f"{plan.parallel.topology.describe()}); a provider declines unless the rows stay put "
            "(layer_boundary.plugin.defers_to_next_input) and the batch has tokens"
        )
    return True


def _scatter_decision(fwd, rs: bool) -> ExitDecision:
    if not rs:
        return COMPLETE_NOW
    return _SCATTERS[fwd.parallel.tp_rank == 0]


class MixerExit(_ExitScope):
    """A single-stage mixer's exit scope. `skips_reduction` says whether compute must leave
    its attention-TP sum (before an FFN always; before another mixer per batch, never under
    attention DP)."""

    __slots__ = ()

    @classmethod
    def open(cls, plan, fwd) -> "MixerExit":
        path = plan.path_for(fwd)
        _stream(fwd)
        ex = path.exit
        if ex.leaves_declared:
            return cls(plan, path, fwd, _LEAVE_DECLARED)
        if ex.may_defer and fwd.num_tokens > 0:
            return cls(plan, path, fwd, _DEFER_SUM)
        return cls(plan, path, fwd, COMPLETE_NOW)

    @property
    def skips_reduction(self) -> bool:
        return self.flags.fuse_mlp_allreduce

    def finish(self, out):
        self._begin_finish()
        plan, path, fwd, decision = self.plan, self.path, self.fwd, self.decision
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {plan.label}: a mixer returns a tensor, got {type(out).__name__}")
        layout = path.exit.compute_rows
        check_rows(plan, out, fwd.num_tokens if layout is _DP_LOCAL else layout.rows(fwd), fwd, "mixer output")
        if decision.declared or decision.defer_sum:
            return _leave_sum(plan, path.exit, out, fwd, declared=decision.declared)
        return complete_reduced(plan, path.exit, out, fwd)


class ParallelFfnExit(FfnExit):
    """The exit scope of a parallel-residual FFN (`ExitPath.joins_carried`).

    Compute always leaves its sum to the boundary. `finish()` adds the attention output that
    the stage's input carried (`CARRIED`) to the FFN's partial output, then one sum completes
    both: deferred to the next input (ordinary rows), reduce-scattered onto the output rows, or
    all-reduced here and moved to them.
    """

    __slots__ = ()

    @classmethod
    def open(cls, plan, fwd) -> "ParallelFfnExit":
        path = plan.path_for(fwd)
        _stream(fwd)
        ex = path.exit
        scatter = ex.scatter
        if scatter is not None and scatter.eligible(fwd):
            return cls(plan, path, fwd, _SCATTERS[False])
        defer = ex.may_defer and fwd.num_tokens > 0
        if defer and plan.fused_consumer_only:
            defer = any(p.can_defer_all_reduce(plan, fwd) for p in plan.all_reduce_providers)
        return cls(plan, path, fwd, _DEFER_SUM if defer else _JOIN_NOW)

    def finish(self, out):
        self._begin_finish()
        plan, path, fwd, decision = self.plan, self.path, self.fwd, self.decision
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {plan.label}: a parallel-residual FFN returns its partial output as a tensor, got {type(out).__name__}")
        ex = path.exit
        check_rows(plan, out, compute_rows(ex, fwd), fwd, "FFN output")
        joined = out + _take_carried(plan, ex, fwd, complete=False)
        if decision.defer_sum:
            owed = UnreducedOutput(joined, ex.group, ex.sum_group, declared=False)
            return _stream(fwd).record(Contribution(None, plan.declaration.update, owed=owed))
        if decision.reduce_scatter:
            return record_complete(plan, ex, ex.scatter.run(joined, fwd, ex.group), fwd)
        return complete_reduced(plan, ex, joined if ex.group.size == 1 else ex.group.all_reduce(joined), fwd)


def join_reduced(plan, ex, out, fwd):
    """A parallel-residual FFN's output that compute already reduced (no exit scope): the carried
    attention output completes on its own sum and joins it."""
    return complete_reduced(plan, ex, out + _take_carried(plan, ex, fwd, complete=True), fwd)


def _take_carried(plan, ex, fwd, *, complete: bool):
    """Take the attention output a parallel-residual FFN's input carried off the stream, on the
    exit's compute rows: its partial (or, `complete=True`, its completed sum; over one
    attention-TP rank it is complete anyway), in this DP rank's slot of DP-gathered rows."""
    stream = _stream(fwd)
    carried = stream.pending
    if carried is None or stream.handle is not CARRIED:
        raise RuntimeError(
            f"stage {plan.label}: a parallel-residual FFN's exit adds the attention output its prepare() took; call this "
            "stage's prepare() with the attention's handle first"
        )
    stream.pending = stream.handle = None
    owed = carried.owed
    attention = carried.value if owed is None else owed.complete() if complete else owed.partial
    carried.owed = carried.value = None  # consumed: the attention's handle retains nothing
    return dp_slot(attention, fwd) if ex.compute_rows is RowLayout.DP_GATHERED else attention
