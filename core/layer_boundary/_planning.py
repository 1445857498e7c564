"""Planning: the frozen `StagePlan` of each stage, with a bound path per supported batch variant.

`plan_stages` is the one planning function. It resolves each stage's facts (`Stage`), asks
the plugins what they contribute (fusion providers and their candidates, a context-parallel
path, row publishers), and derives every entry and exit path from those values with pure
functions. Construction decides everything static: which rows the residual lives on, what an
arriving output owes, which collectives complete it, which fused candidates may take it, which
reduce-scatters an exit may choose. At forward time a boundary only selects the path of the
batch's variant; a variant without a path raises instead of silently using ordinary rows.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Mapping, Optional

import attrs

from . import _describe
from ._checks import norm_hidden_size
from ._contracts import ProducerReduction, ReductionPolicy, StageDescription, StageKind
from ._errors import Messages, missing_feature
from ._forward import BatchVariant, DpPadding, RowLayout
from ._fusions import build_providers, consumer_candidates, equivalent_groups, read_format
from ._layout import SumGroup
from ._ops import dp_gather, dp_reduce_scatter, dp_scatter, gather_slices, reduce_scatter_slices, take_slice
from ._parallel_residual import check_parallel_branch
from ._paths import (
    EntryMode, EntryPath, ExitPath, Owed, ReduceScatter, StagePath, completes_for_split, defers_to_next_input, leaves_post_norm,
    writes_at_exit,
)
from ._residual.add_norm import NormRead, has_add_norm, kernel_norm_kind, norm_kind_of
from ._residual.post_norm import local_read
from ._row_publishers import bind_row_publishers, rows_in_scope
from ._plugins.requests import CpPathRequest, DefersAllReduce, DefersFinalize
from ._plugins.selection import RETURNED_NONE, select

__all__ = ["Stage", "StagePlan", "plan_stages", "arriving_sum", "arriving_post_norm", "output_sum_group"]

SLICE_VARIANTS = (BatchVariant.SEQUENCE_PARALLEL, BatchVariant.INPUT_SCATTERED)


def output_sum_group(decl) -> SumGroup:
    if decl.kind in (StageKind.ATTENTION, StageKind.MIXER):
        return SumGroup.ATTN_TP
    return SumGroup.MOE_OUTPUT if decl.sparse else SumGroup.TP


def arriving_sum(decl, two_batch_overlap: bool = False) -> tuple[Owed, Optional[SumGroup]]:
    """What the output arriving at `decl`'s input may owe, and over which group (in a stack run
    with `two_batch_overlap`, a split point's FFN owes nothing: `completes_for_split`)."""
    prev = decl.previous
    if prev is None or writes_at_exit(prev.update):  # a producer-written stream owes nothing
        return Owed.NOTHING, None
    if completes_for_split(prev, two_batch_overlap):
        return Owed.NOTHING, None
    if prev.kind is StageKind.ATTENTION:
        return Owed.DECLARED, SumGroup.ATTN_TP
    if prev.kind is StageKind.MIXER:
        if decl.kind is StageKind.FFN:
            return Owed.DECLARED, SumGroup.ATTN_TP
        return Owed.DYNAMIC, SumGroup.ATTN_TP
    if prev.reduction is ProducerReduction.LOCAL_TAIL:
        return Owed.NOTHING, None
    return Owed.DYNAMIC, output_sum_group(prev)


def arriving_post_norm(decl, topology, two_batch_overlap: bool = False):
    """The output norm (a core norm module) the output arriving at `decl`'s input leaves for this
    input to apply (`leaves_post_norm`, on ordinary rows), behind a plain add; None elsewhere."""
    source = decl.previous
    if source is None or not source.update.plain_add:
        return None
    if not leaves_post_norm(source, topology, BatchVariant.ORDINARY, two_batch_overlap):
        return None
    return source.output_transform.post_norm


@attrs.frozen(eq=False, repr=False)
class Stage:
    """The facts of one stage: what fusion providers, CP path providers and row publishers see.

    `declaration`, `norm`, `options`, `parallel`, `policy` and `label` are given; the rest is
    derived from them.
    """

    declaration: Any
    norm: Any
    options: Mapping[str, Any] = attrs.field(converter=lambda o: types.MappingProxyType(dict(o)))
    parallel: Any
    policy: ReductionPolicy
    label: str
    #: the engine runs the model with two-batch overlap (`layer_stack(..., two_batch_overlap=True)`)
    two_batch_overlap: bool = False
    kind: StageKind = attrs.field(init=False)
    read: Any = attrs.field(init=False)
    terminal: bool = attrs.field(init=False)
    is_branch: bool = attrs.field(init=False)
    enters_stack: bool = attrs.field(init=False)
    hidden_size: Optional[int] = attrs.field(init=False)
    output_sum: SumGroup = attrs.field(init=False)
    fusions: Any = attrs.field(init=False)
    qkv_latent_func: Any = attrs.field(init=False)
    #: the producer's output norm this input applies before its add (`arriving_post_norm`), or None
    post_norm: Any = attrs.field(init=False)
    #: `(value, residual) -> (compute_input, new_residual)`: a complete output's local completion
    #: at this input, its post-norm (if any), the add and the read, through the chosen kernels
    #: (a candidate that completed a sum its own way hands the total here)
    read_complete: Any = attrs.field(init=False)
    #: what a fusion provider's factory decides from
    description: StageDescription = attrs.field(init=False)

    def __attrs_post_init__(self):
        decl = self.declaration
        is_branch = decl.prepared_from is not None
        facts = dict(
            kind=decl.kind,
            read=decl.read,
            terminal=decl.terminal,
            is_branch=is_branch,
            enters_stack=decl.previous is None and not is_branch,
            hidden_size=norm_hidden_size(self.norm, self.label),
            output_sum=output_sum_group(decl),
            fusions=self.options.get("fusions"),
            qkv_latent_func=self.options.get("qkv_latent_func"),
            post_norm=arriving_post_norm(decl, self.parallel.topology, self.two_batch_overlap),
        )
        facts["read_complete"] = local_read(decl.read, self.norm, facts["post_norm"])
        for name, value in facts.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "description", _description(self))

    def group(self, sum_group: SumGroup):
        """The `Collectives` a sum over `sum_group` runs on."""
        return self.parallel.groups[sum_group.group_name]

    @property
    def norm_name(self) -> str:
        name = type(self.norm).__name__ if self.norm is not None else "no norm"
        fmt = getattr(self.read, "quant_format", None)
        if fmt is not None:
            return f"{name}, quantized to {fmt.replace('_', ' ')} (compute gets an Fp8Input)"
        return name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label}: {self.declaration.describe()})"


def _description(stage: Stage) -> StageDescription:
    decl = stage.declaration
    owed, group = arriving_sum(decl, stage.two_batch_overlap)
    source = decl.previous if decl.previous is not None else decl.prepared_from
    return StageDescription(
        kind=decl.kind,
        label=stage.label,
        sparse=decl.sparse,
        terminal=decl.terminal,
        enters_stack=stage.enters_stack,
        topology=stage.parallel.topology,
        incoming_sum=group if owed is not Owed.NOTHING else None,
        plain_update=bool(source is not None and source.update.plain_add),
        plain_read=bool(decl.read.plain_norm),
        norm_kind=norm_kind_of(stage.norm),
        hidden_size=stage.hidden_size,
        eps=getattr(stage.norm, "eps", None),
        residual=decl.residual,
        reduction=stage.policy,
        output_sum=stage.output_sum,
        read_format=read_format(decl.read),
        post_norm_kind=None if stage.post_norm is None else kernel_norm_kind(stage.post_norm),
    )


@attrs.frozen(eq=False, repr=False)
class StagePlan(Stage):
    """Everything bound for one stage: its facts, its providers, and a path per variant."""

    #: (provider, where it came from) in the order they are asked
    providers: tuple = ()
    #: providers that may let this FFN's MoE defer its finalize (`DefersFinalize`)
    finalize_providers: tuple = ()
    #: providers that may take an FFN's non-all-reduce sum at the next input (`DefersAllReduce`)
    all_reduce_providers: tuple = ()
    paths: Mapping[BatchVariant, StagePath] = attrs.field(factory=dict, converter=lambda p: types.MappingProxyType(dict(p)))
    #: why a variant the topology could carry has no path here (shown by describe and errors)
    unsupported: Mapping[BatchVariant, str] = attrs.field(factory=dict, converter=lambda u: types.MappingProxyType(dict(u)))
    #: the residual this stage's read produces is never written in place by the next local
    #: input path, so a capture of it may be retained without a copy
    capture_owned: bool = False
    #: (kind, publisher) pairs told which rows the compute input holds (`publish_rows=`)
    row_publishers: tuple = ()
    #: an FFN whose sum is not one all-reduce (LoRA): defer only when a provider accepts the batch
    fused_consumer_only: bool = False
    #: `paths` as a plain dict, what `path_for` looks up (a tracer such as Dynamo reads a dict with
    #: enum keys, not a mappingproxy)
    _lookup: dict = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        object.__setattr__(self, "_lookup", dict(self.paths))

    def path_for(self, fwd) -> StagePath:
        path = self._lookup.get(fwd.variant)
        if path is None:
            raise NotImplementedError(self.missing_variant(fwd.variant))
        return path

    def missing_variant(self, variant: BatchVariant) -> str:
        """The guide's error for an absent variant, verbatim on its first line; this stage's
        reason, when one is known, on a second line (so the first line matches the error table)."""
        message = Messages.NO_VARIANT.format(variant=variant.name)
        reason = self.unsupported.get(variant)
        return f"{message}\nstage {self.label}: {reason}" if reason else message

    def describe(self) -> dict:
        return _describe.plan(self)


# ---------------------------------------------------------------------------------------------
# the paths of one variant (pure: facts in, frozen paths out)
# ---------------------------------------------------------------------------------------------


#: why a prepared branch has no path for a variant other than ordinary rows (the guide's rule)
BRANCH_ROWS = "prepared branch transport requires ordinary token rows"


def _slice_refusal(stage: Stage) -> Optional[str]:
    """Why this stage has no sequence-parallel / input-scattered path where its topology could
    carry such a batch ("" where no batch of the topology can be one; None: it has them)."""
    topo = stage.parallel.topology
    decl = stage.declaration
    if topo.attn_dp > 1 or topo.attn_cp > 1 or topo.attn_tp < 2:
        return ""
    if stage.is_branch:
        return BRANCH_ROWS
    if decl.residual_ops is not None and not decl.residual_ops.supports_slices:
        return f"residual kind {decl.residual!r} cannot run on attention-TP slices"
    if decl.is_attention_like and not decl.gathers_tp_input:
        return "its compute cannot take input gathered over attention TP (gathers_tp_input=False)"
    prev = decl.previous
    if prev is not None and prev.is_attention_like and not prev.gathers_tp_input:
        return "the previous stage's compute cannot take input gathered over attention TP (gathers_tp_input=False)"
    return None


def _entry(stage: Stage, variant: BatchVariant, candidates, publishers) -> EntryPath:
    path = _entry_path(stage, variant, candidates, publishers)
    if path.owed is Owed.NOTHING:
        return path
    _, group = arriving_sum(stage.declaration, stage.two_batch_overlap)
    return attrs.evolve(path, owed_groups=equivalent_groups(stage.parallel.topology)[group])


def _entry_path(stage: Stage, variant: BatchVariant, candidates, publishers) -> EntryPath:
    decl = stage.declaration
    topo = stage.parallel.topology
    if stage.is_branch:
        return EntryPath(mode=EntryMode.BRANCH)
    if decl.parallel_residual:
        return _parallel_entry(stage, variant)
    owed, _ = arriving_sum(decl, stage.two_batch_overlap)
    source = decl.previous
    arrives_plain = None if source is None else bool(source.update.plain_add)
    # on attention-TP slices a mixer leaves its sum declared too (see the mixer exit)
    declared_on_slices = source is not None and source.is_attention_like and owed is not Owed.NOTHING
    if owed is Owed.DYNAMIC and not defers_to_next_input(topo, variant):
        owed = Owed.NOTHING  # producers defer only where the rule lets them (and they use the same rule)
    if variant in SLICE_VARIANTS:
        latent = stage.qkv_latent_func
        if decl.is_attention_like and variant is BatchVariant.INPUT_SCATTERED and latent is not None:
            move, name = _LatentMove(latent, stage.label, publishers), "qkv_latent_func on the slice, then all_gatherv@attn_tp of the latent"
        else:
            move, name = gather_slices, "all_gatherv@attn_tp of the input slices"
        return EntryPath(
            mode=EntryMode.ENTER if source is None else EntryMode.SCATTER,
            residual_rows=RowLayout.ATTN_TP_SLICE,
            input_move=move,
            input_move_name=name,
            arrives_plain=arrives_plain,
            owed=Owed.DECLARED if declared_on_slices else owed,
            capture_allocates=True,
        )
    needs_full = decl.kind is StageKind.FFN and topo.attn_dp > 1
    move, name = (dp_gather, "all_gatherv@attn_dp of the input to full rows") if needs_full else (None, "")
    rows = RowLayout.DP_GATHERED if needs_full else RowLayout.DP_LOCAL
    if source is None:
        return EntryPath(mode=EntryMode.ENTER, input_move=move, input_move_name=name, compute_rows=rows)
    plain = arrives_plain and decl.read.plain_norm and source.output_transform is None
    # the producer's post-norm, applied here with the sum, the add and the read (`leaves_post_norm`)
    post = arrives_plain and stage.post_norm is not None and leaves_post_norm(source, topo, variant, stage.two_batch_overlap)
    fusable = arrives_plain and read_format(decl.read) is not None and (source.output_transform is None or post)
    if needs_full and owed is Owed.DECLARED and plain and not decl.read.before_gather and topo.attn_tp > 1 and topo.attn_cp == 1:
        return EntryPath(mode=EntryMode.DP_PARTIAL, input_move=move, arrives_plain=True, owed=owed, compute_rows=rows)
    use_candidates = owed is not Owed.NOTHING and fusable and (post or norm_kind_of(stage.norm) != "other")
    return EntryPath(
        mode=EntryMode.LOCAL,
        input_move=move,
        input_move_name=name,
        candidates=candidates if use_candidates else (),
        arrives_plain=arrives_plain,
        owed=owed,
        add_norm=stage.norm.fused_add_forward if plain and has_add_norm(stage.norm) and type(decl.read) is NormRead else None,
        post_transform=source.output_transform if post else None,
        read_complete=stage.read_complete if post else None,
        compute_rows=rows,
    )


def _parallel_entry(stage: Stage, variant: BatchVariant) -> EntryPath:
    """A parallel-residual FFN's input: its norm of the residual the attention read, on that
    residual's rows, then moved to the compute rows; the attention's output stays pending."""
    if variant in SLICE_VARIANTS:
        return EntryPath(mode=EntryMode.PARALLEL, residual_rows=RowLayout.ATTN_TP_SLICE, input_move=gather_slices,
                         input_move_name="all_gatherv@attn_tp of the input slices", arrives_plain=True, owed=Owed.DECLARED,
                         capture_allocates=True)
    if stage.parallel.topology.attn_dp > 1:
        return EntryPath(mode=EntryMode.PARALLEL, input_move=dp_gather, input_move_name="all_gatherv@attn_dp of the input to full rows",
                         arrives_plain=True, owed=Owed.DECLARED, compute_rows=RowLayout.DP_GATHERED)
    return EntryPath(mode=EntryMode.PARALLEL, arrives_plain=True, owed=Owed.DECLARED)


class _LatentMove:
    """The input move of an input-scattered attention with a `qkv_latent_func`: the latent
    runs on this rank's slice (publishing slice rows to the row publishers, when the stage has
    any), then its output gathers over attention TP."""

    __slots__ = ("latent", "label", "publishers")

    def __init__(self, latent, label: str, publishers: tuple):
        self.latent = latent
        self.label = label
        self.publishers = publishers

    def __call__(self, x, fwd):
        if not self.publishers:
            return gather_slices(self.latent(x), fwd)
        with rows_in_scope(self.label, self.publishers, RowLayout.ATTN_TP_SLICE, fwd):  # the latent runs on the slice
            return gather_slices(self.latent(x), fwd)


def _dp_eligible(rs: bool, rsv: bool, fwd) -> bool:
    padded = fwd.dp_padding is DpPadding.MAX_LEN
    return (rs and padded) or (rsv and not padded)


def _slice_eligible(rs: bool, rsv: bool, fwd) -> bool:
    sizes = fwd.slice_sizes
    return rsv or (rs and min(sizes) == max(sizes))


def _scatter_route(rs: bool, rsv: bool, *, dp: bool) -> Optional[ReduceScatter]:
    """The FFN exit's reduce-scatter under attention DP (over TP, then back to DP rows) or onto
    attention-TP slices, as far as the policy permits it (`rs`, `rsv`)."""
    if not (rs or rsv):
        return None
    if dp:
        kinds = " or ".join(k for k, ok in (("rs (MAX_LEN padding)", rs), ("rsv (SUM_LEN)", rsv)) if ok)
        name = f"reduce_scatter@tp ({kinds}) then all_gatherv@attn_tp back to DP rows (mlp_reduce_scatter)"
        return ReduceScatter(name=name, eligible=functools.partial(_dp_eligible, rs, rsv), run=_dp_scatter)
    name = "reduce_scatterv@attn_tp onto the slice (mlp_reduce_scatter)"
    return ReduceScatter(name=name, eligible=functools.partial(_slice_eligible, rs, rsv), run=_slice_scatter)


def _dp_scatter(out, fwd, group):
    return dp_reduce_scatter(out, fwd)


def _slice_scatter(out, fwd, group):
    return reduce_scatter_slices(out, fwd)


def _exit(stage: Stage, variant: BatchVariant, finalize_ok: bool) -> ExitPath:
    decl = stage.declaration
    topo = stage.parallel.topology
    policy = stage.policy
    transform = decl.output_transform
    update = decl.update
    slices = variant in SLICE_VARIANTS
    defers = defers_to_next_input(topo, variant)
    at_exit = writes_at_exit(update)  # ExitPath.of records it; such an output never leaves its sum
    # a post-norm waits with the sum for the next input, which applies both (`leaves_post_norm`)
    keeps = leaves_post_norm(decl, topo, variant, stage.two_batch_overlap)
    deferrable_update = not at_exit and (transform is None or keeps)
    if decl.kind is StageKind.ATTENTION:
        return ExitPath.of(stage, keeps_post_norm=keeps)
    if decl.parallel_residual:
        return _parallel_exit(stage, variant)
    if decl.kind is StageKind.MIXER:
        following = decl.following
        leaves = not at_exit and (slices or (following is not None and following.kind is StageKind.FFN))
        may_defer = (
            defers and not leaves and not decl.terminal and following is not None and topo.attn_tp > 1 and deferrable_update
        )
        return ExitPath.of(stage, leaves_declared=leaves, may_defer=may_defer, keeps_post_norm=keeps)
    # FFN: a stage with finalize providers asks them on every exit, whatever the variant
    scatter_ok = transform is None or transform.before_reduce_scatter
    if slices:
        scatter = _scatter_route(scatter_ok and policy.allows_rs, scatter_ok and policy.allows_rsv, dp=False)
        return ExitPath.of(stage, output_rows=RowLayout.ATTN_TP_SLICE, output_move=take_slice, output_move_name="this rank's slice",
                           scatter=scatter, asks_finalize=finalize_ok)
    if topo.attn_dp > 1:
        dp_rs = scatter_ok and topo.attn_cp == 1
        scatter = _scatter_route(dp_rs and policy.allows_rs, dp_rs and policy.allows_rsv, dp=True)
        return ExitPath.of(stage, compute_rows=RowLayout.DP_GATHERED, output_move=dp_scatter, output_move_name="this DP rank's rows",
                           scatter=scatter, asks_finalize=finalize_ok)
    scoped = decl.reduction is ProducerReduction.SCOPED
    group = stage.group(stage.output_sum)
    leaves = defers and not completes_for_split(decl, stage.two_batch_overlap)  # a TBO split point completes here
    return ExitPath.of(
        stage,
        may_defer=leaves and not decl.terminal and scoped and deferrable_update and group.size > 1,
        handoff_ok=leaves and finalize_ok and scoped and not at_exit,
        asks_finalize=finalize_ok,
        keeps_post_norm=keeps,
    )


def _parallel_exit(stage: Stage, variant: BatchVariant) -> ExitPath:
    """A parallel-residual FFN's exit: compute always leaves its sum, the attention output the
    input carried joins it, and one sum over TP completes both (deferred to the next input,
    reduce-scattered onto the output rows, or all-reduced here and moved to them)."""
    decl, topo, policy = stage.declaration, stage.parallel.topology, stage.policy
    if variant in SLICE_VARIANTS:
        return ExitPath.of(stage, output_rows=RowLayout.ATTN_TP_SLICE, output_move=take_slice, output_move_name="this rank's slice",
                           scatter=_scatter_route(policy.allows_rs, policy.allows_rsv, dp=False), joins_carried=True)
    if topo.attn_dp > 1:
        return ExitPath.of(stage, compute_rows=RowLayout.DP_GATHERED, output_move=dp_scatter, output_move_name="this DP rank's rows",
                           scatter=_scatter_route(policy.allows_rs, policy.allows_rsv, dp=True), joins_carried=True)
    leaves = defers_to_next_input(topo, variant) and not completes_for_split(decl, stage.two_batch_overlap)
    may_defer = leaves and not decl.terminal and stage.group(stage.output_sum).size > 1
    return ExitPath.of(stage, may_defer=may_defer, joins_carried=True)


def stage_paths(stage: Stage, candidates, *, finalize_ok: bool, publishers: tuple = ()) -> dict[BatchVariant, StagePath]:
    """The ordinary path of `stage`, and its sequence-parallel and input-scattered paths where
    the topology supports them."""
    variants = [BatchVariant.ORDINARY]
    if _slice_refusal(stage) is None:
        variants += list(SLICE_VARIANTS)
    return {v: StagePath(v, _entry(stage, v, candidates, publishers), _exit(stage, v, finalize_ok)) for v in variants}


# ---------------------------------------------------------------------------------------------
# the planning function
# ---------------------------------------------------------------------------------------------


def _context_parallel(stage: Stage, ordinary: StagePath, registry) -> tuple[Optional[StagePath], Optional[str]]:
    """The CP path from the first provider that takes the stage, or the reasons none did."""
    variant = BatchVariant.CONTEXT_PARALLEL
    if stage.is_branch:
        # the guide: construction rejects CP (and SP/IS) for branch transport
        raise NotImplementedError(BRANCH_ROWS)
    providers = registry.cp_paths
    if not providers:
        raise missing_feature(f"context parallel (attn_cp={stage.parallel.topology.attn_cp})", "cp")
    def is_cp_path(path) -> bool:
        """a StagePath for the CONTEXT_PARALLEL variant"""
        return isinstance(path, StagePath) and path.variant is variant

    chosen = select("cp_paths", (CpPathRequest(stage, ordinary),), records=providers, subject=f"planning stage {stage.label}",
                    check=is_cp_path, error_type=TypeError, label=stage.label)
    if chosen.chosen is not None:
        return chosen.value, None
    return None, "; ".join(f"{a.candidate} does not apply" if a.reason == RETURNED_NONE else f"{a.candidate}: {a.reason}"
                           for a in chosen.declined)


def _plan(stage: Stage, registry) -> StagePlan:
    if stage.declaration.parallel_residual:
        check_parallel_branch(stage)
    built = build_providers(stage.fusions, stage.description, registry)
    providers = tuple((p, source) for p, source, _ in built)
    finalize = tuple(p for p, _ in providers if isinstance(p, DefersFinalize))
    all_reduce = tuple(p for p, _ in providers if isinstance(p, DefersAllReduce))
    candidates = consumer_candidates(stage, providers, [plugin for _, _, plugin in built])
    publishers, fused_only = bind_row_publishers(stage, registry)
    paths = stage_paths(stage, candidates, finalize_ok=bool(finalize), publishers=publishers)
    refusal = _slice_refusal(stage)
    unsupported = dict.fromkeys(SLICE_VARIANTS, refusal) if refusal else {}
    if stage.parallel.topology.attn_cp > 1:
        path, reason = _context_parallel(stage, paths[BatchVariant.ORDINARY], registry)
        if path is not None:
            paths[BatchVariant.CONTEXT_PARALLEL] = path
        else:
            unsupported[BatchVariant.CONTEXT_PARALLEL] = reason
    facts = (stage.declaration, stage.norm, stage.options, stage.parallel, stage.policy, stage.label, stage.two_batch_overlap)
    return StagePlan(*facts, providers=providers, finalize_providers=finalize, all_reduce_providers=all_reduce, paths=paths,
                     unsupported=unsupported, row_publishers=publishers, fused_consumer_only=fused_only)


def plan_stages(items, *, parallel, policy: ReductionPolicy, label: str, registry, two_batch_overlap: bool = False) -> tuple[StagePlan, ...]:
    """The plans of locally connected stages (`(declaration, norm, options)` items in order).

    Each plan's declaration records the stage's label (`built_as`). The capture certificate
    flows producer-ward: a stage may hand a capture of the residual it reads without a copy
    when the next local stage's input path never writes it in place.
    """
    labels = [label if len(items) == 1 else f"{label}.{i}:{decl.kind.value}" for i, (decl, _, _) in enumerate(items)]
    stages = [
        Stage(attrs.evolve(decl, built_as=name), norm, options, parallel, policy, name, two_batch_overlap)
        for name, (decl, norm, options) in zip(labels, items)
    ]
    plans = [_plan(stage, registry) for stage in stages]
    _check_mixer_neighbours(plans[-1])
    out = []
    for current, nxt in zip(plans, plans[1:] + [None]):
        entry = nxt.paths[BatchVariant.ORDINARY].entry if nxt is not None else None
        owned = entry is not None and entry.mode is EntryMode.LOCAL and entry.preserves_residual
        out.append(attrs.evolve(current, capture_owned=True) if owned else current)
    return tuple(out)


def _check_mixer_neighbours(last: StagePlan) -> None:
    decl = last.declaration
    if decl.kind is StageKind.MIXER and not decl.terminal and decl.following is None:
        raise ValueError(
            f"stage {last.label}: a mixer that ends its make_stages call needs following= (the declaration of the next "
            "stage), unless it is terminal; the next stage derives whether the mixer's sum is left to it from the same fact"
        )
