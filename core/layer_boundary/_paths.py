"""The values a plan is made of: entry and exit paths per batch variant, and their vocabulary.

Every path is a frozen value, bound once at construction; at forward time a boundary only
selects the path of the batch's variant and runs it. Modes, roles and what an arriving output
owes are enums; rows are `RowLayout` members; moves are plain functions `(x, forward) -> x`
with a name for plans.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

import attrs

from ._exit import COMPLETE_NOW
from ._forward import BatchVariant, RowLayout
from ._layout import SumGroup

__all__ = [
    "EntryMode", "ExitRole", "Owed", "ReduceScatter", "EntryPath", "ExitPath", "StagePath", "defers_to_next_input", "writes_at_exit",
    "completes_for_split", "leaves_post_norm",
]


def defers_to_next_input(topology, variant: BatchVariant) -> bool:
    """The deferral rule, written once: a producer leaves a sum or a MoE finalize for the next
    stage's input to complete only on ordinary rows, without attention DP or CP (elsewhere rows
    move at the boundary, and the exit completes the output on its way). Producer exits and
    consumer entries both decide with it, so a sum never runs twice or never."""
    return variant is BatchVariant.ORDINARY and topology.attn_dp == 1 and topology.attn_cp == 1


def writes_at_exit(update) -> bool:
    """The producer-update rule, written once: an update that asks to run at the producer
    (`at_producer`), or whose parameters and state are not guaranteed to outlive the producer's
    layer (`outlives_layer=False`), runs at the producer's exit. The exit completes the output
    there (its sum, transform and rows) and writes the stream; nothing is left for the next
    input, which the consumer's entry derives from the same declaration (`previous=`)."""
    return bool(update.at_producer or not update.outlives_layer)


def completes_for_split(decl, two_batch_overlap: bool) -> bool:
    """The TBO handoff rule, written once (the guide: handoff rows derive from `sparse` /
    `next_sparse`): in a model run with two-batch overlap, a batch may split into microbatches
    where a dense FFN meets a sparse layer (`declare_ffn(sparse=False, next_sparse=True)`). That
    FFN completes its output at its exit, on attention rows (the rows a split cuts), and the next
    input, whose `previous=` is the same declaration, expects nothing owed."""
    return bool(two_batch_overlap) and decl.kind.value == "ffn" and not decl.sparse and decl.next_sparse


def leaves_post_norm(decl, topology, variant: BatchVariant, two_batch_overlap: bool = False) -> bool:
    """The post-norm rule, written once: a producer whose output transform is a norm
    (`OutputTransform.post_norm`) leaves it, with its sum where one is owed, for the next input,
    which completes sum, norm, add and its own read in one call, wherever the deferral rule lets
    outputs wait (`defers_to_next_input`) and the update does not run at the producer. The exit
    (which then records the output with its norm pending) and the consumer's entry (which then
    binds the fused completion) decide with it."""
    transform = decl.output_transform
    return (
        transform is not None
        and transform.post_norm is not None
        and defers_to_next_input(topology, variant)
        and not writes_at_exit(decl.update)
        and not completes_for_split(decl, two_batch_overlap)
    )


class EntryMode(enum.Enum):
    """How a stage's input is prepared."""

    ENTER = "enter"  #: stack entry (initial or written stream): read without an update
    #: complete what is owed on the residual's rows (fused candidates first when eligible),
    #: then update and read; an optional input move then moves the input
    LOCAL = "local"
    DP_PARTIAL = "dp_partial"  #: one TP all-reduce completes the attention-TP sum and gathers over DP
    SCATTER = "scatter"  #: reduce-scatter onto attention-TP slices, update and read on the slice
    BRANCH = "branch"  #: a prepared branch, entered through `branch_input` only
    #: a parallel-residual FFN: read the residual the attention before it read, and carry that
    #: attention's pending output (nothing completes here) to this stage's exit
    PARALLEL = "parallel"


class ExitRole(enum.Enum):
    """How a stage's output leaves it."""

    DECLARED = "declared"  #: attention (PARTIAL): the output always leaves its attention-TP sum
    #: a SCOPED token mixer: leaves the sum before an FFN, may defer it before another mixer,
    #: else its compute reduces
    MIXER = "mixer"
    #: an FFN: defers its sum to the next input, reduce-scatters it, or lets compute reduce, per batch
    FFN = "ffn"


class Owed(enum.Enum):
    """What an output arriving at a stage's input may still owe."""

    NOTHING = "nothing"
    DECLARED = "declared"  #: the sum the producer's contract always leaves (attention, a mixer before an FFN)
    DYNAMIC = "dynamic"  #: a sum or a finalize the producer's exit may defer, per batch


@attrs.frozen(kw_only=True)
class ReduceScatter:
    """An FFN exit's optional reduce-scatter: compute leaves its sum (`mlp_reduce_scatter`) and
    the exit scatters it straight onto the output rows.

    `eligible(forward)` decides per batch from facts every rank shares; `run(partial, forward,
    group)` returns the complete output on this rank's output rows; `name` is the plan's line.
    """

    name: str
    eligible: Callable[[Any], bool]
    run: Callable[[Any, Any, Any], Any]


@attrs.frozen(kw_only=True, eq=False)
class EntryPath:
    """The consumer half of a boundary for one batch variant."""

    mode: EntryMode
    #: where the residual lives once this stage has read it
    residual_rows: RowLayout = RowLayout.DP_LOCAL
    #: the rows the compute input holds (published to the stage's row publishers, such as LoRA)
    compute_rows: RowLayout = RowLayout.DP_LOCAL
    #: moves the compute input from the residual's rows to the compute rows, `(x, forward) -> x`
    input_move: Optional[Callable] = None
    input_move_name: str = ""
    #: what an arriving output may owe here
    owed: Owed = Owed.NOTHING
    #: the sum groups an owed output may complete over here (those running over the same ranks
    #: as the declared one); empty where nothing may be owed
    owed_groups: frozenset = frozenset()
    #: the producer's update is a plain add (None: no producer)
    arrives_plain: Optional[bool] = None
    #: fused consumer candidates, in order (the last never declines)
    candidates: tuple = ()
    #: the norm's add + norm (its chosen kernel) when the read is a plain norm of an RMSNorm (bound once)
    add_norm: Optional[Callable] = None
    #: the producer's post-norm transform this entry completes itself (`leaves_post_norm`), or None:
    #: a contribution arriving with exactly this transform pending is completed by the candidates
    #: (a sum still owed) or by `read_complete` (a complete output), post-norm included
    post_transform: Optional[Any] = None
    #: `(value, residual) -> (compute_input, new_residual)`: the post-norm, add and read of a
    #: complete output in one call (`Stage.read_complete`), where `post_transform` is set
    read_complete: Optional[Callable] = None
    #: a capture of the residual on the producer's rows allocates (it gathers rows)
    capture_allocates: bool = False
    #: checks the batch before anything moves, `(forward) -> None` (a CP token mapping, say)
    precheck: Optional[Callable] = None
    #: the common case, run by the lean entry: local mode, nothing to check first
    fast: bool = attrs.field(init=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "fast", self.mode is EntryMode.LOCAL and self.precheck is None)

    @property
    def preserves_residual(self) -> bool:
        return all(c.fused.preserves_residual for c in self.candidates)


@attrs.frozen(kw_only=True, eq=False)
class ExitPath:
    """The producer half: how a stage's output reaches the residual's rows."""

    role: ExitRole
    sum_group: SumGroup
    group: Any
    #: where the complete output (or the contribution still owing its sum) lands
    output_rows: RowLayout = RowLayout.DP_LOCAL
    #: the rows compute returns
    compute_rows: RowLayout = RowLayout.DP_LOCAL
    #: compute rows -> output rows, `(x, forward) -> x`: after compute reduced, and before a sum is left
    output_move: Optional[Callable] = None
    output_move_name: str = ""
    #: a mixer that always leaves its attention-TP sum (before an FFN; on attention-TP slices)
    leaves_declared: bool = False
    #: the sum may be deferred to the next input (per batch: it has tokens, providers accept)
    may_defer: bool = False
    #: a provider may let the MoE hand its finalize to the next input
    handoff_ok: bool = False
    #: the stage has finalize providers (`DefersFinalize`): every exit asks them (they decline
    #: where `handoff_ok` is False or the batch has no tokens)
    asks_finalize: bool = False
    #: the optional reduce-scatter onto the output rows
    scatter: Optional[ReduceScatter] = None
    #: the producer's update runs at this exit (`writes_at_exit`): the output completes here and
    #: the stream is written; nothing is deferred or left declared
    writes_at_exit: bool = False
    #: a parallel-residual FFN: the attention output its input carried joins this exit's partial
    #: output (on the compute rows; into this DP rank's slot of them when they are DP-gathered),
    #: and one sum completes both
    joins_carried: bool = False
    #: the output transform is a post-norm the next input applies (`leaves_post_norm`): the exit
    #: records the output (complete or owing its sum) with the norm still pending
    keeps_post_norm: bool = False
    #: the decision of an FFN exit that no batch fact can change (exits then share it)
    static_decision: Any = attrs.field(init=False)

    def __attrs_post_init__(self):
        static = self.role is ExitRole.FFN and not self.joins_carried and not (
            self.may_defer or self.handoff_ok or self.asks_finalize or self.scatter is not None
        )
        object.__setattr__(self, "static_decision", COMPLETE_NOW if static else None)

    @classmethod
    def of(cls, stage, **fields) -> "ExitPath":
        """A path builder: the exit of `stage` over its own output sum group, its role from the
        stage's kind unless given."""
        sum_group = fields.pop("sum_group", stage.output_sum)
        role = fields.pop("role", _ROLES[stage.kind.value])
        fields.setdefault("writes_at_exit", writes_at_exit(stage.declaration.update))
        return cls(role=role, sum_group=sum_group, group=stage.group(sum_group), **fields)


_ROLES = {"attention": ExitRole.DECLARED, "mixer": ExitRole.MIXER, "ffn": ExitRole.FFN}


@attrs.frozen(eq=False)
class StagePath:
    variant: BatchVariant
    entry: EntryPath
    exit: ExitPath
