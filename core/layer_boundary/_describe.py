"""What `describe()` and `layer-boundary plan` say about a plan: generated from the plan's own
values (modes, roles, rows, candidates, moves), so the text cannot drift from what runs."""

from __future__ import annotations

from ._forward import RowLayout
from ._paths import EntryMode, ExitRole, Owed
from ._residual.add_norm import describe_add_norm
from ._row_publishers import describe_publication

__all__ = ["plan", "entry", "exit"]

_OWES = {Owed.DECLARED: "the declared sum", Owed.DYNAMIC: "a deferred sum or finalize, when left", Owed.NOTHING: "nothing"}


def entry(path, plan) -> list[str]:
    if path.mode is EntryMode.BRANCH:
        return ["enter through branch_input (input already prepared by the source stage)"]
    steps: list[str] = []
    norm = plan.norm_name
    if path.mode is EntryMode.ENTER:
        if path.residual_rows is not RowLayout.DP_LOCAL:
            steps.append(f"take {path.residual_rows.phrase} of the stack input")
        steps.append(f"enter the residual, read with {norm}")
    elif path.mode is EntryMode.DP_PARTIAL:
        steps.append("attn-TP rank 0 adds the residual into its partial")
        steps.append("all_reduce@tp over the DP-gathered rows (completes the attention-TP sum and gathers DP)")
        steps.append(f"keep this DP rank's rows as the residual; {norm} on full rows")
        steps.append("(fallback when the sum arrives complete: add + norm locally, then all_gatherv@attn_dp)")
    elif path.mode is EntryMode.PARALLEL:
        steps += _parallel_entry(path, plan)
    elif path.mode is EntryMode.SCATTER:
        steps.append("reduce_scatterv@attn_tp onto attention-TP slices when a sum is owed (else take the slice)")
        steps.append(f"update and read on the slice with {norm}")
    elif path.owed is Owed.NOTHING:
        steps.append(f"update and read with {norm}")
    elif path.candidates:
        names = ", ".join(c.name for c in path.candidates)
        steps.append(f"complete {_OWES[path.owed]} through the first accepting candidate: {names}")
    else:
        steps.append(f"complete {_OWES[path.owed]} unfused, then update and read with {norm}")
    if path.post_transform is not None:
        post = path.post_transform
        steps.append(f"the producer's post-norm {post.name} ({type(post.post_norm).__name__}) runs here, on the completed output "
                     "before the add, in the same call")
    if path.input_move_name:
        steps.append(path.input_move_name)
    if path.compute_rows is RowLayout.ATTN_CP_LOCAL:
        steps.append("compute runs on this CP rank's rows and fetches the other rows' keys and values itself")
    if plan.row_publishers:
        steps.append(describe_publication(plan, path.compute_rows))
    return steps


def _attention_sum(plan) -> str:
    """The attention sum a parallel-residual FFN carries, as the plan names it."""
    if plan.parallel.topology.attn_tp == 1:
        return "the attention's output (complete: one attention-TP rank)"
    return "the attention's attn_tp partial (its declared sum)"


def _parallel_entry(path, plan) -> list[str]:
    rows = "this rank's slice of the residual" if path.residual_rows is RowLayout.ATTN_TP_SLICE else "the residual"
    return [
        f"read {rows} as the attention read it (its output still pending) with {plan.norm_name}",
        f"carry {_attention_sum(plan)} to this stage's exit, where it joins this FFN's partial (parallel residual)",
    ]


def _parallel_exit(path, plan) -> list[str]:
    g = path.sum_group.group_name
    if path.group.size == 1:
        return [f"add {_attention_sum(plan)} to this FFN's output (one rank: nothing to sum)"]
    steps = [f"compute leaves its {g} sum; {_attention_sum(plan)} joins this FFN's partial: one sum over {g} completes both"]
    if path.compute_rows is RowLayout.DP_GATHERED:
        steps[0] = (
            f"compute leaves its {g} sum; {_attention_sum(plan)} joins this FFN's partial in this DP rank's slot of the full "
            f"rows (zeros elsewhere): one sum over {g} completes both, each slot adding its own attention ranks' outputs"
        )
    if path.may_defer:
        steps.append(f"defer that all_reduce@{g} to the next input when the batch has tokens (fuse_mlp_allreduce)")
    if path.scatter is not None:
        steps.append(path.scatter.name)
    otherwise = "else " if path.may_defer or path.scatter is not None else ""
    keep = f", keep {path.output_move_name}" if path.output_move_name else ""
    steps.append(f"{otherwise}all_reduce@{g} here (fuse_mlp_allreduce){keep}")
    return steps


def exit(path, plan) -> list[str]:  # noqa: A001 - the plan's "exit" half
    steps = _exit_steps(path, plan)
    if path.keeps_post_norm:
        transform = plan.declaration.output_transform
        steps.append(f"leave the post-norm {transform.name} ({type(transform.post_norm).__name__}) for the next input, which "
                     "applies it to the completed output")
    return steps


def _exit_steps(path, plan) -> list[str]:
    g = path.sum_group.name
    on_rows = f", on {path.output_rows.short}" if path.output_rows is not RowLayout.DP_LOCAL else ""
    if path.role is ExitRole.DECLARED or path.leaves_declared:
        take = f"take {path.output_move_name}; " if path.output_move_name else ""
        following = plan.declaration.following
        if following is not None and following.parallel_residual:
            return [f"{take}leave the {g} sum (declared) to the parallel-residual FFN after it, which carries it to its exit{on_rows}"]
        return [f"{take}leave the {g} sum (declared) for the next input{on_rows}"]
    if path.joins_carried:
        return _parallel_exit(path, plan)
    steps = []
    if path.may_defer and not plan.fused_consumer_only:
        steps.append(f"defer the {g} all-reduce to the next input when the batch has tokens (fuse_mlp_allreduce)")
    elif path.may_defer and plan.all_reduce_providers:
        steps.append(f"defer the {g} all-reduce to the next input when a provider accepts the batch (can_defer_all_reduce)")
    if path.handoff_ok:
        steps.append("a provider may let the MoE hand its finalize to the next input (defer_moe_finalize)")
    if path.scatter is not None:
        steps.append(path.scatter.name)
    otherwise = "else " if path.may_defer or path.handoff_ok or path.scatter is not None else ""
    keep = f"; keep {path.output_move_name}" if path.output_move_name else on_rows
    steps.append(f"{otherwise}compute all-reduces over {g}{keep}")
    return steps


def plan(p) -> dict:
    decl = p.declaration
    out = {
        "label": p.label,
        "stage": decl.describe(),
        "producer": decl.previous.describe() if decl.previous is not None else ("branch source" if p.is_branch else "stack input"),
        "consumer": decl.following.describe() if decl.following is not None else ("final norm" if p.terminal else "next stage"),
        "variants": {v.value: {"entry": entry(path.entry, p), "exit": exit(path.exit, p)} for v, path in p.paths.items()},
    }
    add_norm = None if p.enters_stack or p.is_branch else describe_add_norm(p.norm)  # the stack entry only norms
    if add_norm is not None:
        out["add_norm"] = add_norm
    if p.post_norm is not None:
        out["post_norm"] = p.read_complete.describe()
    if p.unsupported:
        out["unsupported"] = {v.value: reason for v, reason in p.unsupported.items()}
    return out
