"""Building a `StagePlan`: resolve each supported batch variant into bound entry and exit paths.

Construction decides everything static: which rows the residual lives on, which sum an
arriving output owes, which collectives complete it, which fused candidates may take it,
which reduce-scatters an exit may choose. At forward time a plan only selects the path of the
batch's variant; a variant it has no path for raises instead of silently using ordinary rows.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs

from ._errors import Messages, missing_feature
from .contracts import ProducerReduction, ReductionPolicy, StageDescription, StageKind
from .forward import BatchVariant, RowLayout
from .fusions import Candidate, build_providers, consumer_candidates, read_format
from .layout import SumGroup
from .ops import dp_gather, gather_slices
from .residual.add_norm import GemmaRMSNorm, NormRead, is_rms_norm
from .residual.stream import ATTENTION_ROWS, SLICE_ROWS

__all__ = ["EntryPath", "ExitPath", "StagePath", "StagePlan", "plan_stage", "arriving_sum"]

SLICE_VARIANTS = (BatchVariant.SEQUENCE_PARALLEL, BatchVariant.INPUT_SCATTERED)


@attrs.define(slots=True, eq=False)
class EntryPath:
    """The consumer half of a boundary for one batch variant.

    mode:
    - "enter": stack entry (initial or written stream), read without an update;
    - "local": complete what is owed on the residual's rows (fused candidates first when
      eligible), then update and read; an optional `input_move` then moves the input;
    - "dp_partial": one TP all-reduce completes the attention-TP sum and gathers over DP;
    - "scatter": reduce-scatter onto attention-TP slices, update and read on the slice;
    - "branch": a prepared branch, entered through `branch_input` only;
    - "adapter": an adapter's own entry (context parallel).
    """

    mode: str
    residual_rows: str = ATTENTION_ROWS
    input_move: Optional[Callable] = None
    input_move_name: str = ""
    candidates: tuple[Candidate, ...] = ()
    arrives_plain: Optional[bool] = None
    expects: str = "nothing"  # "declared", "dynamic", "nothing"
    slices_on_entry: bool = False
    capture_allocates: bool = False
    adapter: Any = None
    #: the norm's own fused add + norm when the read is a plain norm of an RMSNorm (bound once)
    add_norm: Optional[Callable] = None
    #: the rows the compute input holds (published to the stage's row adapters, such as LoRA)
    compute_rows: RowLayout = RowLayout.DP_LOCAL

    @property
    def preserves_residual(self) -> bool:
        return all(c.fused.preserves_residual for c in self.candidates)

    def describe(self, plan: "StagePlan") -> list[str]:
        steps: list[str] = []
        if self.mode == "branch":
            return ["enter through branch_input (input already prepared by the source stage)"]
        if self.mode == "adapter":
            return list(self.adapter.describe_entry(plan))
        if self.mode == "enter":
            if self.slices_on_entry:
                steps.append("take this rank's attention-TP slice of the stack input")
            steps.append(f"enter the residual, read with {plan.norm_name}")
        elif self.mode == "dp_partial":
            steps.append("attn-TP rank 0 adds the residual into its partial")
            steps.append("all_reduce@tp over the DP-gathered rows (completes the attention-TP sum and gathers DP)")
            steps.append(f"keep this DP rank's rows as the residual; {plan.norm_name} on full rows")
            steps.append("(fallback when the sum arrives complete: add + norm locally, then all_gatherv@attn_dp)")
        elif self.mode == "scatter":
            steps.append("reduce_scatterv@attn_tp onto attention-TP slices when a sum is owed (else take the slice)")
            steps.append(f"update and read on the slice with {plan.norm_name}")
        else:
            owes = {"declared": "the declared sum", "dynamic": "a deferred sum or finalize, when left", "nothing": "nothing"}[self.expects]
            if self.candidates and self.expects != "nothing":
                names = ", ".join(c.name for c in self.candidates)
                steps.append(f"complete {owes} through the first accepting candidate: {names}")
            elif self.expects != "nothing":
                steps.append(f"complete {owes} unfused, then update and read with {plan.norm_name}")
            else:
                steps.append(f"update and read with {plan.norm_name}")
        if self.input_move_name:
            steps.append(self.input_move_name)
        if plan.row_adapters:
            from .row_adapters import describe_publication

            steps.append(describe_publication(plan, self.compute_rows))
        return steps


@attrs.define(slots=True, eq=False)
class ExitPath:
    """The producer half: how a stage's output reaches the residual's rows.

    role:
    - "declared": attention (PARTIAL); the output always leaves its attention-TP sum;
    - "mixer": a SCOPED token mixer; leaves the sum before an FFN, may defer it before another
      mixer (never under attention DP), else its compute reduces;
    - "ffn": an FFN; defers its sum to the next input, reduce-scatters it, or lets compute
      reduce, per batch;
    - "adapter": an adapter's own exit (context parallel).
    """

    role: str
    sum_group: SumGroup
    group: Any
    output_rows: str = ATTENTION_ROWS
    leaves_declared: bool = False
    may_defer: bool = False
    handoff_ok: bool = False
    rs_kind: Optional[str] = None  # None, "dp" or "slice"
    rs_allowed: bool = False
    rsv_allowed: bool = False
    complete_move: Optional[str] = None  # None, "dp_scatter" or "slice"
    #: compute sees (and returns) the DP-gathered full rows rather than the attention rows
    compute_rows_full: bool = False
    adapter: Any = None
    #: set when no batch fact can change the decision (then exits reuse one decision object)
    static_decision: Any = None

    def describe(self, plan: "StagePlan") -> list[str]:
        if self.role == "adapter":
            return list(self.adapter.describe_exit(plan))
        g = self.sum_group.name
        if self.role == "declared" or self.leaves_declared:
            return [f"leave the {g} sum (declared) for the next input"]
        steps = []
        if self.may_defer and not plan.fused_consumer_only:
            steps.append(f"defer the {g} all-reduce to the next input when the batch has tokens (fuse_mlp_allreduce)")
        elif self.may_defer and plan.all_reduce_providers:
            steps.append(f"defer the {g} all-reduce to the next input when a provider accepts the batch (can_defer_all_reduce)")
        if self.handoff_ok:
            steps.append("a provider may let the MoE hand its finalize to the next input (defer_moe_finalize)")
        if self.rs_kind == "dp":
            kinds = [k for k, ok in (("rs (MAX_LEN padding)", self.rs_allowed), ("rsv (SUM_LEN)", self.rsv_allowed)) if ok]
            if kinds:
                steps.append(f"reduce_scatter@tp ({' or '.join(kinds)}) then all_gatherv@attn_tp back to DP rows (mlp_reduce_scatter)")
        if self.rs_kind == "slice" and (self.rs_allowed or self.rsv_allowed):
            steps.append("reduce_scatterv@attn_tp onto the slice (mlp_reduce_scatter)")
        move = {"dp_scatter": ", then keep this DP rank's rows", "slice": ", then keep this rank's slice", None: ""}[self.complete_move]
        steps.append(f"else compute all-reduces over {g}{move}")
        return steps


@attrs.define(slots=True, eq=False)
class StagePath:
    variant: BatchVariant
    entry: EntryPath
    exit: ExitPath


class StagePlan:
    """Everything bound for one stage: declaration, norm, providers, and a path per variant."""

    def __init__(self, declaration, norm, options, parallel, policy: ReductionPolicy, label: str):
        self.declaration = declaration
        self.kind: StageKind = declaration.kind
        self.norm = norm
        self.options = options
        self.parallel = parallel
        self.policy = policy
        self.label = label
        self.terminal = declaration.terminal
        self.is_branch = declaration.prepared_from is not None
        self.enters_stack = declaration.previous is None and not self.is_branch
        self.read = declaration.read
        self.hidden_size = getattr(norm, "hidden_size", None)
        self.qkv_latent_func = options.get("qkv_latent_func")
        self.fusions = options.get("fusions")
        self.providers: list[tuple[Any, str]] = []
        self.finalize_providers: tuple = ()
        self.all_reduce_providers: tuple = ()
        self.paths: dict[BatchVariant, StagePath] = {}
        #: why a variant the topology could carry has no path here (shown by describe and errors)
        self.unsupported: dict[BatchVariant, str] = {}
        self.description: Optional[StageDescription] = None
        #: the residual this stage's read produces is never written in place by the next local
        #: input path, so a capture of it may be retained without a copy
        self.capture_owned = False
        #: an FFN whose sum is not one all-reduce (LoRA, TP1 shared expert): defer only when a
        #: provider accepts the batch (`can_defer_all_reduce`)
        self.fused_consumer_only = False
        #: (kind, adapter) pairs told which rows the compute input holds (`publish_rows=`)
        self.row_adapters: tuple = ()

    # runtime selection ----------------------------------------------------------------------
    def path_for(self, fwd) -> StagePath:
        try:
            return self.paths[fwd.variant]
        except KeyError:
            raise NotImplementedError(self.missing_variant(fwd.variant)) from None

    def missing_variant(self, variant: BatchVariant) -> str:
        """The guide's error for an absent variant, with this stage's reason when one is known."""
        message = Messages.NO_VARIANT.format(variant=variant.name)
        reason = self.unsupported.get(variant)
        return f"{message} (stage {self.label}: {reason})" if reason else message

    # facts for providers ----------------------------------------------------------------------
    @property
    def norm_name(self) -> str:
        name = type(self.norm).__name__ if self.norm is not None else "no norm"
        fmt = getattr(self.read, "quant_format", None)
        if fmt is not None:
            return f"{name}, quantized to {fmt.replace('_', ' ')} (compute gets an Fp8Input)"
        return name

    def group(self, sum_group: SumGroup):
        return self.parallel.groups[sum_group.group_name]

    @property
    def output_sum(self) -> Optional[SumGroup]:
        return output_sum_group(self.declaration)

    def describe(self) -> dict:
        decl = self.declaration
        out = {
            "label": self.label,
            "stage": decl.describe(),
            "producer": decl.previous.describe() if decl.previous is not None else ("branch source" if self.is_branch else "stack input"),
            "consumer": decl.following.describe() if decl.following is not None else ("final norm" if self.terminal else "next stage"),
            "variants": {
                v.value: {"entry": p.entry.describe(self), "exit": p.exit.describe(self)} for v, p in self.paths.items()
            },
        }
        if self.unsupported:
            out["unsupported"] = {v.value: reason for v, reason in self.unsupported.items()}
        return out

    def __repr__(self) -> str:
        return f"StagePlan({self.label}: {self.declaration.describe()})"


def output_sum_group(decl) -> Optional[SumGroup]:
    if decl.kind in (StageKind.ATTENTION, StageKind.MIXER):
        return SumGroup.ATTN_TP
    return SumGroup.MOE_OUTPUT if decl.sparse else SumGroup.TP


def arriving_sum(decl) -> tuple[str, Optional[SumGroup]]:
    """What the output arriving at `decl`'s input may owe: ("declared"|"dynamic"|"nothing", group)."""
    prev = decl.previous
    if prev is None:
        return "nothing", None
    if prev.kind is StageKind.ATTENTION:
        return "declared", SumGroup.ATTN_TP
    if prev.kind is StageKind.MIXER:
        if decl.kind is StageKind.FFN:
            return "declared", SumGroup.ATTN_TP
        return "dynamic", SumGroup.ATTN_TP
    if prev.reduction is ProducerReduction.LOCAL_TAIL:
        return "nothing", None
    return "dynamic", output_sum_group(prev)


def _norm_kind(norm) -> str:
    if isinstance(norm, GemmaRMSNorm):
        return "gemma_rms"
    return "rms" if is_rms_norm(norm) else "other"


def describe_stage(plan: StagePlan) -> StageDescription:
    decl = plan.declaration
    expects, group = arriving_sum(decl)
    source = decl.previous if decl.previous is not None else decl.prepared_from
    return StageDescription(
        kind=decl.kind,
        label=plan.label,
        sparse=decl.sparse,
        terminal=decl.terminal,
        enters_stack=plan.enters_stack,
        topology=plan.parallel.topology,
        incoming_sum=group if expects != "nothing" else None,
        plain_update=bool(source is not None and source.update.plain_add),
        plain_read=bool(decl.read.plain_norm),
        norm_kind=_norm_kind(plan.norm),
        hidden_size=getattr(plan.norm, "hidden_size", None),
        eps=getattr(plan.norm, "eps", None),
        residual=decl.residual,
        reduction=plan.policy,
        output_sum=output_sum_group(decl),
        read_format=read_format(decl.read),
    )


# ---------------------------------------------------------------------------------------------
# the planner
# ---------------------------------------------------------------------------------------------


def _supports_slices(plan: StagePlan) -> bool:
    topo = plan.parallel.topology
    decl = plan.declaration
    if topo.attn_dp > 1 or topo.attn_cp > 1 or topo.attn_tp < 2 or plan.is_branch:
        return False
    if decl.residual_ops is not None and not decl.residual_ops.supports_slices:
        return False
    if decl.is_attention_like and not decl.gathers_tp_input:
        return False
    prev = decl.previous
    if prev is not None and prev.is_attention_like and not prev.gathers_tp_input:
        return False
    return True


def _entry(plan: StagePlan, variant: BatchVariant, candidates) -> EntryPath:
    decl = plan.declaration
    topo = plan.parallel.topology
    if plan.is_branch:
        return EntryPath(mode="branch")
    expects, _ = arriving_sum(decl)
    source = decl.previous
    arrives_plain = None if source is None else bool(source.update.plain_add)
    slices = variant in SLICE_VARIANTS
    if expects == "dynamic" and (topo.attn_dp > 1 or topo.attn_cp > 1 or variant is not BatchVariant.ORDINARY):
        expects = "nothing"  # producers defer sums and finalizes only on ordinary rows without DP/CP
    if slices:
        if decl.is_attention_like and variant is BatchVariant.INPUT_SCATTERED and plan.qkv_latent_func is not None:
            latent = plan.qkv_latent_func

            def move(x, fwd, _latent=latent, _plan=plan):
                if not _plan.row_adapters:
                    return gather_slices(_latent(x), fwd)
                from .row_adapters import rows_in_scope

                with rows_in_scope(_plan, RowLayout.ATTN_TP_SLICE, fwd):  # the latent runs on the slice
                    return gather_slices(_latent(x), fwd)

            name = "qkv_latent_func on the slice, then all_gatherv@attn_tp of the latent"
        else:
            move, name = gather_slices, "all_gatherv@attn_tp of the input slices"
        mode = "enter" if source is None else "scatter"
        # an SP/IS mixer before a mixer leaves its sum declared too (see MixerExit)
        return EntryPath(
            mode=mode,
            residual_rows=SLICE_ROWS,
            input_move=move,
            input_move_name=name,
            arrives_plain=arrives_plain,
            expects="declared" if source is not None and source.is_attention_like else expects,
            slices_on_entry=True,
            capture_allocates=True,
        )
    needs_full = decl.kind is StageKind.FFN and topo.attn_dp > 1
    move, name = (dp_gather, "all_gatherv@attn_dp of the input to full rows") if needs_full else (None, "")
    rows = RowLayout.DP_GATHERED if needs_full else RowLayout.DP_LOCAL
    if source is None:
        return EntryPath(mode="enter", input_move=move, input_move_name=name, compute_rows=rows)
    plain = arrives_plain and decl.read.plain_norm and source.output_transform is None
    fusable = arrives_plain and read_format(decl.read) is not None and source.output_transform is None
    if (
        needs_full
        and expects == "declared"
        and plain
        and not decl.read.before_gather
        and topo.attn_tp > 1
        and topo.attn_cp == 1
    ):
        return EntryPath(
            mode="dp_partial", input_move=move, input_move_name="", arrives_plain=True, expects=expects, compute_rows=rows
        )
    use_candidates = expects != "nothing" and fusable and is_rms_norm(plan.norm)
    return EntryPath(
        mode="local",
        input_move=move,
        input_move_name=name,
        candidates=candidates if use_candidates else (),
        arrives_plain=arrives_plain,
        expects=expects,
        add_norm=plan.norm.add_forward if plain and is_rms_norm(plan.norm) and type(decl.read) is NormRead else None,
        compute_rows=rows,
    )


def _exit(plan: StagePlan, variant: BatchVariant) -> ExitPath:
    decl = plan.declaration
    topo = plan.parallel.topology
    policy = plan.policy
    sum_group = output_sum_group(decl)
    group = plan.group(sum_group)
    transform = decl.output_transform
    update = decl.update
    slices = variant in SLICE_VARIANTS
    deferrable_update = update.outlives_layer and not update.at_producer and transform is None
    if decl.kind is StageKind.ATTENTION:
        return ExitPath(role="declared", sum_group=sum_group, group=group)
    if decl.kind is StageKind.MIXER:
        following = decl.following
        leaves = slices or (following is not None and following.kind is StageKind.FFN)
        may_defer = (
            not leaves
            and not decl.terminal
            and following is not None
            and topo.attn_dp == 1
            and topo.attn_tp > 1
            and deferrable_update
        )
        return ExitPath(role="mixer", sum_group=sum_group, group=group, leaves_declared=leaves, may_defer=may_defer)
    # FFN
    scatter_ok = transform is None or transform.before_reduce_scatter
    if slices:
        return ExitPath(
            role="ffn",
            sum_group=sum_group,
            group=group,
            output_rows=SLICE_ROWS,
            rs_kind="slice",
            rs_allowed=scatter_ok and policy.allows_rs,
            rsv_allowed=scatter_ok and policy.allows_rsv,
            complete_move="slice",
        )
    if topo.attn_dp > 1:
        dp_rs = scatter_ok and topo.attn_cp == 1
        return ExitPath(
            role="ffn",
            sum_group=sum_group,
            group=group,
            rs_kind="dp",
            rs_allowed=dp_rs and policy.allows_rs,
            rsv_allowed=dp_rs and policy.allows_rsv,
            complete_move="dp_scatter",
            compute_rows_full=True,
        )
    may_defer = (
        not decl.terminal
        and decl.reduction is ProducerReduction.SCOPED
        and deferrable_update
        and topo.attn_cp == 1
        and group.size > 1
    )
    return ExitPath(
        role="ffn",
        sum_group=sum_group,
        group=group,
        may_defer=may_defer,
        handoff_ok=bool(plan.finalize_providers) and decl.reduction is ProducerReduction.SCOPED,
    )


def _decision_is_static(ex: ExitPath) -> bool:
    """An FFN exit that can only let compute reduce (no deferral, scatter or handoff)."""
    return ex.role == "ffn" and not (ex.may_defer or ex.handoff_ok or ex.rs_allowed or ex.rsv_allowed)


def plan_stage(declaration, norm, options, *, parallel, policy, label, registry) -> StagePlan:
    """Build one stage's plan with a path for every variant the topology supports."""
    plan = StagePlan(declaration, norm, options, parallel, policy, label)
    plan.description = describe_stage(plan)
    plan.providers = build_providers(plan.fusions, plan.description, registry)
    plan.finalize_providers = tuple(p for p, _ in plan.providers if hasattr(p, "can_defer_finalize"))
    plan.all_reduce_providers = tuple(p for p, _ in plan.providers if hasattr(p, "can_defer_all_reduce"))
    candidates = consumer_candidates(plan, plan.providers)
    variants = [BatchVariant.ORDINARY]
    if _supports_slices(plan):
        variants += list(SLICE_VARIANTS)
    for variant in variants:
        exit_path = _exit(plan, variant)
        if _decision_is_static(exit_path):
            from .exit import COMPLETE_NOW

            exit_path.static_decision = COMPLETE_NOW
        plan.paths[variant] = StagePath(variant, _entry(plan, variant, candidates), exit_path)
    if parallel.topology.attn_cp > 1:
        _bind_context_parallel(plan, registry)
    if options.get("publish_rows"):
        from .row_adapters import bind_row_adapters

        bind_row_adapters(plan, registry)
    return plan


def _bind_context_parallel(plan: StagePlan, registry) -> None:
    """Ask the adapters of kind "cp" for this stage's CP path, in registry order.

    A factory returns a `StagePath` (entry mode "adapter", exit role "adapter"), None when it
    does not apply, or raises `NotImplementedError(reason)` for a stage it knows it cannot carry.
    A stage no adapter takes keeps no CP path: its ordinary (decode) path still works, and a CP
    batch raises the guide's NO_VARIANT error with the recorded reason.
    """
    variant = BatchVariant.CONTEXT_PARALLEL
    if plan.is_branch:
        # the guide: construction rejects CP (and SP/IS) for branch transport
        raise NotImplementedError("prepared branch transport requires ordinary token rows")
    adapters = registry.adapters_of("cp")
    if not adapters:
        raise missing_feature(f"context parallel (attn_cp={plan.parallel.topology.attn_cp})", "cp")
    reasons = []
    for item in adapters:
        try:
            bound = item.record.factory(plan)
        except NotImplementedError as exc:
            reasons.append(f"{item.name}: {exc}")
            continue
        if bound is not None:
            if not isinstance(bound, StagePath) or bound.variant is not variant:
                raise TypeError(f"CP adapter {item.name!r} must return a StagePath for {variant!r}, got {bound!r}")
            plan.paths[variant] = bound
            return
        reasons.append(f"{item.name} does not apply")
    plan.unsupported[variant] = "; ".join(reasons)
