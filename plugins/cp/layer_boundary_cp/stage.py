"""The context-parallel path of one stage, built at construction from its ordinary path with
the core's public path builders; the core runs it like any other path.

Which rows each stage computes on, under an active CP batch:
- the residual always lives on this CP rank's rows (`RowLayout.ATTN_CP_LOCAL`) of its
  attention-DP rank's batch, replicated over attention TP; every read and update runs there,
  so norms and residual adds are split over CP ranks;
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
boundary (the core's deferral rule): an FFN output is complete on this rank's rows when its exit
finishes.
"""

from __future__ import annotations

import attrs

from layer_boundary import BatchVariant, RowLayout, StageKind
from layer_boundary.plugin import EntryMode, ExitPath, ReduceScatter, StagePath, dp_gather, dp_scatter, move_residual

__all__ = ["build_stage_path", "check_mapping"]

GATHER_NAME = "all_gatherv@attn_cp of the input back to token order (the token mapping)"
GATHER_DP_NAME = GATHER_NAME + ", then all_gatherv@attn_dp to full rows"
TAKE_NAME = "this CP rank's rows of the full-row output"
CP_ROWS = RowLayout.ATTN_CP_LOCAL


def gather_input(x, fwd):
    """The entry's input move: this rank's rows -> its DP rank's rows in token order."""
    return move_residual(x, fwd.cp.gather)


def gather_input_over_dp(x, fwd):
    """An FFN's input move under attention DP: over CP, then over DP to every DP rank's rows."""
    return dp_gather(fwd.cp.gather(x), fwd)


def take_local(x, fwd):
    """A full-row output -> this CP rank's rows (no communication)."""
    return fwd.cp.take_local(x)


def take_local_over_dp(x, fwd):
    """An FFN's full-row output under attention DP -> this DP rank's rows -> this CP rank's."""
    return fwd.cp.take_local(dp_scatter(x, fwd))


def _scatter(rs: bool, rsv: bool):
    """One reduce-scatter over TP onto CP ranks' rows, then an all-gather over attention TP."""
    if not (rs or rsv):
        return None
    kinds = " or ".join(k for k, ok in (("rs (equal shares)", rs), ("rsv", rsv)) if ok)

    def eligible(fwd, _rsv=rsv):
        shares = fwd.cp.tp_shares(fwd.parallel.topology.attn_tp)
        return _rsv or min(shares) == max(shares)

    return ReduceScatter(
        name=f"reduce_scatterv@tp ({kinds}) onto CP ranks' rows, then all_gatherv@attn_tp (mlp_reduce_scatter)",
        eligible=eligible,
        run=lambda out, fwd, group: fwd.cp.reduce_scatter(out, group),
    )


def build_stage_path(request) -> StagePath:
    """The CP `StagePath` of a stage; raises NotImplementedError(reason) for one it cannot carry."""
    stage, ordinary = request.stage, request.ordinary.entry
    decl = stage.declaration
    if decl.residual_ops is not None and not decl.residual_ops.supports_slices:
        raise NotImplementedError(f"residual kind {decl.residual!r} cannot read and update a share of the rows")
    if ordinary.mode not in (EntryMode.ENTER, EntryMode.LOCAL):
        raise NotImplementedError(f"a {ordinary.mode.value!r} entry has no context-parallel form")
    full_rows = not (decl.is_attention_like and decl.takes_cp_shard)
    over_dp = decl.kind is StageKind.FFN and stage.parallel.topology.attn_dp > 1
    # (rows compute sees, input move and its name, output move back to CP rows and its name)
    if over_dp:
        rows, move, name = RowLayout.DP_GATHERED, gather_input_over_dp, GATHER_DP_NAME
        back, back_name = take_local_over_dp, "this DP rank's rows, then " + TAKE_NAME
    elif full_rows:
        rows, move, name, back, back_name = RowLayout.DP_LOCAL, gather_input, GATHER_NAME, take_local, TAKE_NAME
    else:
        rows, move, name, back, back_name = CP_ROWS, None, "", None, ""
    entry = attrs.evolve(ordinary, residual_rows=CP_ROWS, compute_rows=rows, input_move=move, input_move_name=name,
                         capture_allocates=True, precheck=check_mapping)
    transform = decl.output_transform
    scatter_ok = decl.kind is StageKind.FFN and not over_dp and (transform is None or transform.before_reduce_scatter)
    following = decl.following
    # a mixer before an FFN always leaves its attention-TP sum to the FFN's input
    leaves = decl.kind is StageKind.MIXER and following is not None and following.kind is StageKind.FFN
    scatter = _scatter(scatter_ok and stage.policy.allows_rs, scatter_ok and stage.policy.allows_rsv)
    exit_path = ExitPath.of(stage, output_rows=CP_ROWS, compute_rows=rows, output_move=back, output_move_name=back_name,
                            leaves_declared=leaves, scatter=scatter)
    return StagePath(BatchVariant.CONTEXT_PARALLEL, entry, exit_path)


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
