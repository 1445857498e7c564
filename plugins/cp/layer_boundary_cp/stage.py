"""The context-parallel path of one stage, bound at construction.

Which rows each stage computes on, under an active CP batch:
- the residual always lives on this CP rank's rows (`CP_ROWS`) of its attention-DP rank's
  batch, replicated over attention TP; every read and update runs there, so norms and residual
  adds are split over CP ranks;
- an attention or mixer declared `takes_cp_shard=True` computes on those rows and fetches the
  keys and values of the other rows itself (`Forward.cp.gather`); any other one gets its input
  gathered to its DP rank's full rows first, and its output is returned to this rank's rows;
- an FFN is tensor-parallel over the whole TP group (attention DP x CP x TP), whose ranks must
  see the same rows: its input is gathered over CP (then over attention DP), and its output
  comes back either by the all-reduce compute runs followed by taking this rank's rows, or,
  without attention DP and where the policy permits, by one reduce-scatter over TP onto CP
  ranks' rows (`mlp_reduce_scatter`; each rank's mapping knows only its own DP rank's partition,
  so under attention DP the reduce-scatter is never eligible).

Sums: the attention-TP sum of an attention output is left, as always, for the next input, on
this rank's rows (fused candidates may complete it there). Nothing is deferred across a CP
boundary: an FFN output is complete on this rank's rows when its exit finishes.
"""

from __future__ import annotations

import attrs
import torch

from layer_boundary._planning import ExitPath, StagePath, output_sum_group
from layer_boundary._contracts import StageKind
from layer_boundary._exit import COMPLETE_NOW, ExitDecision, FfnExit, MixerExit, record_complete
from layer_boundary._forward import BatchVariant, ComputeFlags
from layer_boundary._ops import dp_gather, dp_scatter, move_residual
from layer_boundary._output import HandoffOutput, UnreducedOutput
from layer_boundary._prepare import run_entry, run_local
from layer_boundary._residual.stream import CP_ROWS, Contribution

__all__ = ["ContextParallelStage", "build_stage_path"]

GATHER_NAME = "all_gatherv@attn_cp of the input back to token order (the token mapping)"
GATHER_DP_NAME = GATHER_NAME + ", then all_gatherv@attn_dp to full rows"


def gather_input(x, fwd):
    """The entry's input move: this rank's rows -> its DP rank's rows in token order."""
    return move_residual(x, fwd.cp.gather)


def gather_input_over_dp(x, fwd):
    """An FFN's input move under attention DP: over CP, then over DP to every DP rank's rows."""
    return dp_gather(fwd.cp.gather(x), fwd)


def build_stage_path(plan):
    """The CP `StagePath` of a stage; raises NotImplementedError(reason) for one it cannot carry."""
    decl = plan.declaration
    if decl.residual_ops is not None and not decl.residual_ops.supports_slices:
        raise NotImplementedError(f"residual kind {decl.residual!r} cannot read and update a share of the rows")
    ordinary = plan.paths[BatchVariant.ORDINARY].entry
    if ordinary.mode not in ("enter", "local"):
        raise NotImplementedError(f"a {ordinary.mode!r} entry has no context-parallel form")
    adapter = ContextParallelStage(plan)
    if adapter.returns_over_dp:
        move, name = gather_input_over_dp, GATHER_DP_NAME
    elif adapter.computes_on_full_rows:
        move, name = gather_input, GATHER_NAME
    else:
        move, name = None, ""
    entry = attrs.evolve(
        ordinary, residual_rows=CP_ROWS, input_move=move, input_move_name=name, slices_on_entry=False, capture_allocates=True
    )
    adapter.entry = entry
    sum_group = output_sum_group(decl)
    return StagePath(
        BatchVariant.CONTEXT_PARALLEL,
        attrs.evolve(ordinary, mode="adapter", adapter=adapter, residual_rows=CP_ROWS),
        ExitPath(role="adapter", sum_group=sum_group, group=plan.group(sum_group), output_rows=CP_ROWS, adapter=adapter),
    )


class ContextParallelStage:
    """Entry and exit of one stage for a CP batch; the rows come from `forward.cp`."""

    def __init__(self, plan):
        decl = plan.declaration
        self.kind = decl.kind
        self.computes_on_full_rows = not (decl.is_attention_like and decl.takes_cp_shard)
        #: an FFN under attention DP computes on every DP rank's rows
        self.returns_over_dp = decl.kind is StageKind.FFN and plan.parallel.topology.attn_dp > 1
        self.entry = None  # the core entry path on CP rows (set by build_stage_path)
        transform = decl.output_transform
        scatter_ok = (
            decl.kind is StageKind.FFN
            and not self.returns_over_dp
            and (transform is None or transform.before_reduce_scatter)
        )
        self.rs_allowed = scatter_ok and plan.policy.allows_rs
        self.rsv_allowed = scatter_ok and plan.policy.allows_rsv
        following = decl.following
        #: a mixer before an FFN always leaves its attention-TP sum to the FFN's input
        self.mixer_leaves_sum = decl.kind is StageKind.MIXER and following is not None and following.kind is StageKind.FFN

    # consumer side ----------------------------------------------------------------------------
    def prepare(self, plan, path, hidden, fwd, capture_output=None, captured=None):
        check_mapping(fwd)
        entry = self.entry
        if entry.mode == "local" and capture_output is None and captured is None:
            return run_local(plan, entry, hidden, fwd)
        return run_entry(plan, entry, hidden, fwd, capture_output, captured)

    # producer side ----------------------------------------------------------------------------
    def finish_attention(self, plan, path, out, fwd):
        """A PARTIAL attention: its attention-TP sum is left for the next input, on CP rows."""
        if self.computes_on_full_rows:
            out = fwd.cp.take_local(out)  # taking rows commutes with the sum: reduce fewer rows
        return leave_sum(plan, path.exit, out, fwd)

    def ffn_exit(self, plan, path, fwd):
        decision = COMPLETE_NOW
        if self.rs_allowed or self.rsv_allowed:
            shares = fwd.cp.tp_shares(fwd.parallel.topology.attn_tp)
            if self.rsv_allowed or min(shares) == max(shares):
                flags = ComputeFlags(mlp_reduce_scatter=True, owns_local_tail=fwd.parallel.tp_rank == 0)
                decision = ExitDecision(flags, reduce_scatter=True)
        return CpFfnExit(plan, path, fwd, decision)

    def mixer_exit(self, plan, path, fwd):
        if self.mixer_leaves_sum:
            return CpMixerExit(plan, path, fwd, ExitDecision(ComputeFlags(fuse_mlp_allreduce=True), declared=True))
        return CpMixerExit(plan, path, fwd, COMPLETE_NOW)

    def postprocess(self, plan, path, out, fwd):
        """Output compute already reduced (no exit scope): back to CP rows, transform, record."""
        return self.complete_on_local_rows(plan, out, fwd)

    def complete_on_local_rows(self, plan, out, fwd):
        if self.returns_over_dp:
            out = dp_scatter(out, fwd)
        if self.computes_on_full_rows:
            out = fwd.cp.take_local(out)
        transform = plan.declaration.output_transform
        if transform is not None:
            out = transform(out)
        return record_complete(plan, out, CP_ROWS, fwd)

    # descriptions -----------------------------------------------------------------------------
    def describe_entry(self, plan) -> list[str]:
        steps = []
        if self.entry.mode == "enter":
            steps.append("take this CP rank's rows of the stack input (token mapping, no communication)")
        steps.extend(self.entry.describe(plan))
        if not self.computes_on_full_rows:
            steps.append("compute runs on this CP rank's rows and fetches the other rows' keys and values itself")
        return steps

    def describe_exit(self, plan) -> list[str]:
        g = plan.output_sum.name
        if self.kind is StageKind.ATTENTION or self.mixer_leaves_sum:
            take = "take this CP rank's rows of the full-row output; " if self.computes_on_full_rows else ""
            return [f"{take}leave the {g} sum (declared) for the next input, on CP rows"]
        steps = []
        if self.rs_allowed or self.rsv_allowed:
            kinds = " or ".join(k for k, ok in (("rs (equal shares)", self.rs_allowed), ("rsv", self.rsv_allowed)) if ok)
            steps.append(f"reduce_scatterv@tp ({kinds}) onto CP ranks' rows, then all_gatherv@attn_tp (mlp_reduce_scatter)")
        where = "this CP rank's rows of the full-row output" if self.computes_on_full_rows else "the output on CP rows"
        if self.returns_over_dp:
            where = "this DP rank's rows, then " + where
        steps.append(f"{'else ' if steps else ''}compute all-reduces over {g}; keep {where}")
        return steps


def check_mapping(fwd) -> None:
    """Before anything moves: the batch's `cp` is a token mapping that describes this forward."""
    mapping = fwd.cp
    check = getattr(mapping, "check", None)
    if check is not None:
        check(fwd)
        return
    if not all(callable(getattr(mapping, m, None)) for m in ("take_local", "gather", "reduce_scatter", "tp_shares")):
        raise TypeError(
            f"Forward(cp=...) needs a token mapping (layer_boundary_cp.TokenMapping, or an object with take_local, gather, "
            f"reduce_scatter and tp_shares), got {type(mapping).__name__}"
        )


def leave_sum(plan, ex, out, fwd):
    """Record an output on CP rows whose sum over `ex.group` the next input completes."""
    decl = plan.declaration
    stream = fwd.residual_stream
    if ex.group.size == 1:
        transform = decl.output_transform
        return stream.record(Contribution(out if transform is None else transform(out), decl.update, rows=CP_ROWS))
    owed = UnreducedOutput(out, ex.group, ex.sum_group, declared=True)
    return stream.record(Contribution(None, decl.update, owed=owed, transform=decl.output_transform, rows=CP_ROWS))


class CpFfnExit(FfnExit):
    """An FFN exit under CP: reduce-scatter onto CP rows, or take CP rows of the reduced output."""

    __slots__ = ()

    def finish(self, out):
        self._begin_finish()
        plan, fwd = self.plan, self.fwd
        if isinstance(out, HandoffOutput):
            raise RuntimeError(
                f"stage {plan.label} returned a HandoffOutput under context parallel, whose exit never publishes "
                "defer_moe_finalize; finalize inside the MoE unless get_forward().defer_moe_finalize is set"
            )
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {plan.label}: compute must return a tensor, got {type(out).__name__}")
        if not self.decision.reduce_scatter:
            return self.path.exit.adapter.complete_on_local_rows(plan, out, fwd)
        transform = plan.declaration.output_transform
        if transform is not None:
            out = transform(out)  # allowed only when declared before_reduce_scatter
        return record_complete(plan, fwd.cp.reduce_scatter(out, self.path.exit.group), CP_ROWS, fwd)


class CpMixerExit(MixerExit):
    """A single-stage mixer's exit under CP: its output goes back to CP rows."""

    __slots__ = ()

    def finish(self, out):
        self._begin_finish()
        plan, fwd = self.plan, self.fwd
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {plan.label}: a mixer returns a tensor, got {type(out).__name__}")
        adapter = self.path.exit.adapter
        if self.decision.declared:
            if adapter.computes_on_full_rows:
                out = fwd.cp.take_local(out)
            return leave_sum(plan, self.path.exit, out, fwd)
        return adapter.complete_on_local_rows(plan, out, fwd)
