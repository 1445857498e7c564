"""`StageBoundary`: the model-facing object of one stage."""

from __future__ import annotations

from typing import Mapping

from ._checks import check_rows
from ._contracts import StageKind
from ._errors import Messages
from ._exit import (
    COMPLETE_NOW, FfnExit, MixerExit, ParallelFfnExit, PlainFfnExit, complete_reduced, compute_rows, join_reduced, plain_ffn_exit,
    record_attention, record_lean,
)
from ._exit import _Tensor  # the hot exits' shared shortcut (see _exit.py)
from ._features import resolve_branch_transport
from ._forward import BatchVariant, RowLayout
from ._ops import align_rows
from ._output import UnreducedOutput
from ._paths import EntryMode, Owed
from ._planning import StagePlan, arriving_sum, plan_stages
from ._prepare import run_entry, run_local, run_parallel
from ._residual.stream import ResidualStream
from ._row_publishers import publish_rows
from ._plugins.manager import get_registry

ATTENTION_ROWS = RowLayout.DP_LOCAL
_DP_LOCAL = RowLayout.DP_LOCAL
_ORDINARY = BatchVariant.ORDINARY
#: what no contribution's update is (a stage without `previous=` expects none)
_NO_UPDATE = object()

__all__ = ["StageBoundary", "build_boundaries", "boundaries_of"]


class StageBoundary:
    """Prepare a stage's input, take its output, and leave the rest to the next boundary.

    Everything a call could decide from the plan alone is decided here, once: per batch variant,
    the entry a lean `prepare()` runs, the attention exit whose `finish()` only records, and the
    FFN exit whose decision no batch fact changes. The calls then look up the variant's value and
    run; anything else takes the general path, which makes every check and raises every error.
    """

    __slots__ = (
        "plan",
        "declaration",
        "_entries",
        "_lean_entries",
        "_arriving_update",
        "_exits",
        "_recording_exits",
        "_static_exits",
        "_plain_exits",
        "_update",
        "_hidden_size",
        "_lean_ordinary",
        "_recording_ordinary",
        "_plain_ordinary",
        "_ffn_exit",
        "branch_transport",
    )

    def __init__(self, plan: StagePlan):
        self.plan = plan
        self.declaration = plan.declaration
        self._entries = {variant: path.entry for variant, path in plan.paths.items()}
        #: entries `prepare()` runs inline: local, nothing to check first, the norm's add + norm
        #: bound, the input staying on the residual's rows
        self._lean_entries = {
            variant: entry
            for variant, entry in self._entries.items()
            if entry.fast and entry.add_norm is not None and entry.input_move is None
        }
        previous = plan.declaration.previous
        #: the update `previous=` declares: a contribution carrying this very object matches the
        #: entry's capability (`arrives_plain` is derived from it), so the inline entry compares
        #: identities; any other update takes `run_local`, which compares the capability
        self._arriving_update = previous.update if previous is not None else _NO_UPDATE
        self._exits = {variant: path.exit for variant, path in plan.paths.items()}
        self._update = plan.declaration.update
        transform = plan.declaration.output_transform
        #: attention exits whose finish() only records the output: one rank owes no sum, and no
        #: update, move or transform runs at the exit
        self._recording_exits = {
            variant: ex
            for variant, ex in self._exits.items()
            if plan.kind is StageKind.ATTENTION and ex.group.size == 1 and not ex.writes_at_exit and ex.output_move is None and transform is None
        }
        #: FFN paths whose exit decision no batch fact can change (`ExitPath.static_decision`)
        self._static_exits = {
            variant: path for variant, path in plan.paths.items() if plan.kind is StageKind.FFN and path.exit.static_decision is not None
        }
        #: of those, the exits whose output is recorded as it is (`plain_ffn_exit`)
        self._plain_exits = {variant: path for variant, path in self._static_exits.items() if plain_ffn_exit(plan, path)}
        self._hidden_size = plan.hidden_size
        # The ordinary batch's values of the three hot lookups, read after an identity test of the
        # variant: a dict lookup keyed by an enum runs Enum.__hash__ (a Python frame), four times a
        # layer, and the enum keeps its own hash for torch 2.11's Dynamo (see `BatchVariant`)
        self._lean_ordinary = self._lean_entries.get(_ORDINARY)
        self._recording_ordinary = self._recording_exits.get(_ORDINARY)
        self._plain_ordinary = self._plain_exits.get(_ORDINARY)
        #: the exit scope an FFN opens when its decision depends on the batch
        self._ffn_exit = ParallelFfnExit if plan.declaration.parallel_residual else FfnExit
        #: a prepared branch's transport (`branch_input`), found once here
        self.branch_transport = resolve_branch_transport(self) if plan.declaration.prepared_from is not None else None

    # consumer side ----------------------------------------------------------------------------
    def prepare(self, hidden_states, forward, *, capture_output=None, captured_last_layer_outputs=None, post_residual_addition=None):
        """Complete what the previous output owes, apply its update, read, move the input.

        `post_residual_addition` (attention stages; a tensor on attention rows) is added to the
        residual after the producer's update and before the read; `capture_output` then captures
        the output plus residual before that addition (the guide's rule). Returns the compute
        input in the consumer read's format.
        """
        capturing = capture_output is not None or captured_last_layer_outputs is not None or post_residual_addition is not None
        if not capturing:
            variant = forward.variant
            entry = self._lean_ordinary if variant is _ORDINARY else self._lean_entries.get(variant)
            if entry is not None:
                # `run_local`'s commonest case, inlined: the handle of a complete output under the
                # declared plain add, read by the norm's add + norm bound at construction
                stream = forward.residual_stream
                pending = None if stream is None else stream.pending
                if (
                    pending is not None
                    and hidden_states is stream.handle
                    and pending.owed is None
                    and pending.transform is None
                    and pending.update is self._arriving_update
                    and stream.residual is not None
                ):
                    stream.pending = stream.handle = None
                    inp, residual = entry.add_norm(pending.value, stream.residual)
                    pending.value = None  # consumed: the caller's handle retains nothing
                    stream.spare = pending  # complete: the next lean finish() refills it
                    stream.residual = residual
                    stream.rows = entry.residual_rows
                    return inp
                return run_local(self.plan, entry, hidden_states, forward)
            entry = self._entries.get(forward.variant)
            if entry is not None and entry.fast:
                return run_local(self.plan, entry, hidden_states, forward)
        plan = self.plan
        entry = plan.path_for(forward).entry
        if entry.mode is EntryMode.BRANCH:
            raise RuntimeError(Messages.BRANCH_PREPARE)
        if capturing and plan.kind is StageKind.FFN:
            what = "post_residual_addition" if post_residual_addition is not None else "capture_output"
            raise TypeError(f"FFN prepare() does not accept {what}; capture at an attention input or the final norm")
        if entry.mode is EntryMode.PARALLEL:
            return run_parallel(plan, entry, hidden_states, forward)
        if entry.precheck is not None:
            entry.precheck(forward)
            if entry.mode is EntryMode.LOCAL and not capturing:
                return run_local(plan, entry, hidden_states, forward)
        return run_entry(plan, entry, hidden_states, forward, capture_output, captured_last_layer_outputs, post_residual_addition)

    # producer side ----------------------------------------------------------------------------
    def finish(self, output, forward):
        """Register a PARTIAL attention's contribution; returns the handle to pass on."""
        variant = forward.variant
        ex = self._recording_ordinary if variant is _ORDINARY else self._recording_exits.get(variant)
        if ex is not None:
            # `record_attention` over one rank, inlined for a well-formed output on a stream with
            # nothing pending; anything else takes `record_attention`, which raises its errors
            stream = forward.residual_stream
            if (
                type(output) is _Tensor
                and stream is not None
                and stream.pending is None
                and record_lean(stream, output, forward, ex, self._hidden_size, self._update)
            ):
                return output
            return record_attention(self.plan, output, forward, ex)
        if self.plan.kind is not StageKind.ATTENTION:
            raise RuntimeError(
                f"a {self.plan.kind.value} stage publishes its output through exit(): "
                "`with boundary.exit(forward) as out: h = compute(h)` then `h = out.finish(h)`"
            )
        ex = self._exits.get(forward.variant)
        if ex is None:
            ex = self.plan.path_for(forward).exit  # raises for a variant without a path
        return record_attention(self.plan, output, forward, ex)

    def exit(self, forward):
        """Open the exit scope of an FFN (`FfnExit`) or a single-stage mixer (`MixerExit`)."""
        if forward.residual_stream is not None:
            variant = forward.variant
            path = self._plain_ordinary if variant is _ORDINARY else self._plain_exits.get(variant)
            if path is not None:
                return PlainFfnExit(self.plan, path, forward, COMPLETE_NOW)
            path = self._static_exits.get(forward.variant)
            if path is not None:
                return FfnExit(self.plan, path, forward, path.exit.static_decision)
        kind = self.plan.kind
        if kind is StageKind.FFN:
            return self._ffn_exit.open(self.plan, forward)
        if kind is StageKind.MIXER:
            return MixerExit.open(self.plan, forward)
        raise RuntimeError("an attention stage (PARTIAL) publishes its output with finish(), not exit()")

    def postprocess(self, output, forward):
        """For compute run without an exit scope (operation-scheduled overlap): the output is
        fully reduced; apply the output transform, move it back to the handoff rows, owe nothing."""
        if self.plan.kind is StageKind.ATTENTION:
            raise RuntimeError("postprocess() is for FFN and mixer stages; attention publishes with finish()")
        path = self.plan.path_for(forward)
        check_rows(self.plan, output, compute_rows(path.exit, forward), forward, "output")
        if path.exit.joins_carried:
            return join_reduced(self.plan, path.exit, output, forward)
        return complete_reduced(self.plan, path.exit, output, forward)

    # capture and pipeline ---------------------------------------------------------------------
    def capture_output(self, hidden_states, forward):
        """(handle, snapshot): completes dynamic work on the main output, snapshots a declared sum
        on a copy (the main output still owes it)."""
        from ._residual import batch

        stream = forward.residual_stream
        if stream is None:
            raise RuntimeError(Messages.NOT_STARTED)
        pending = stream.pending
        if pending is not None and not (isinstance(pending.owed, UnreducedOutput) and pending.owed.declared):
            hidden_states = stream.complete(hidden_states)
        return hidden_states, batch.snapshot(hidden_states, forward)

    def from_pp(self, tensors: Mapping, forward, *, transport: str = "replicated", residual_optional: bool = False):
        """Rebuild the stream on the first local stage of a pipeline rank from `to_pp()`'s tensors.

        The stage completes the sum its `previous=` declares, unless `to_pp()` reported
        (`owes_declared_sum`) that the sender already completed it; a partial arriving where no
        sum is declared is an error (the two ranks describe the edge differently).

        `to_pp()` always exports a `residual` entry (None for a written stream). A handoff without
        it is refused, so a transport that drops the key (or its None) cannot pass a pending
        output off as a written stream; `residual_optional=True` takes a missing entry as a
        written stream. `transport` must be the one the sender's `to_pp()` used: over
        `"row_slices"` a partial cannot travel (the sender completes it).
        """
        from ._residual.batch import check_pp_transport

        plan = self.plan
        if plan.enters_stack or plan.is_branch:
            raise RuntimeError("from_pp() belongs on the first stage after a pipeline cut (a stage with previous=)")
        if plan.declaration.parallel_residual:
            raise RuntimeError(
                f"from_pp() at stage {plan.label}: a parallel-residual FFN reads the residual its attention read, in the same "
                "forward, so no pipeline cut lies between them; cut before the attention"
            )
        check_pp_transport(transport)
        if "residual" not in tensors and not residual_optional:
            raise ValueError(
                f"from_pp() at stage {plan.label}: the handoff has no 'residual' entry; to_pp() always exports one (None "
                "for a written stream), so the transport dropped it: carry it (or its None), or pass "
                "residual_optional=True if this transport only ever hands on written streams"
            )
        hidden = tensors["hidden_states"]
        residual = tensors.get("residual")
        path = plan.path_for(forward)
        owes = tensors.get("owes_declared_sum")
        owes = None if owes is None else bool(owes)  # a transported flag may arrive as a tensor
        declared = path.entry.owed is Owed.DECLARED
        if owes and transport == "row_slices":
            raise ValueError(
                f"from_pp() at stage {plan.label}: the sender handed off a partial sum, which cannot travel as row slices "
                "(gathered slices of different ranks' partials sum to nothing); call to_pp(..., transport=\"row_slices\") "
                "on the sender, which completes the sum before the export"
            )
        if owes is None and declared and transport == "row_slices":
            owes = False  # the sender's to_pp(transport="row_slices") completed it
        if owes and not declared:
            decl = plan.declaration
            raise ValueError(
                f"from_pp() at stage {plan.label}: the sender handed off a partial sum it leaves declared (an attention, "
                f"or a mixer built with following= an FFN), but this {decl.describe()} stage with "
                f"previous={decl.previous.describe()} expects a complete output; describe the same edge on both "
                "pipeline ranks (the sender's following= must be this stage's declaration)"
            )
        rows = path.entry.residual_rows
        # the slice entry reduce-scatters attention-row partials itself; others complete on the residual's rows
        contribution_rows = ATTENTION_ROWS if rows is RowLayout.ATTN_TP_SLICE else rows
        update = plan.declaration.previous.update
        if residual is None:
            stream, handle = ResidualStream.arrive(align_rows(hidden, ATTENTION_ROWS, rows, forward), None, None, rows=rows)
        else:
            if not (update.plain_add or update.at_producer):
                raise NotImplementedError("pipeline boundaries require a plain add or a producer-written residual")
            _, sum_group = arriving_sum(plan.declaration, plan.two_batch_overlap)
            owed_sum = transform = None
            group = plan.group(sum_group) if sum_group is not None else None
            # owes False: the sender completed the sum; over one rank the producer recorded its
            # output complete with the transform applied
            if declared and owes is not False and group.size > 1:
                transform = plan.declaration.previous.output_transform
                owed_sum = lambda h: UnreducedOutput(h, group, sum_group, declared=True)  # noqa: E731
            stream, handle = ResidualStream.arrive(
                align_rows(hidden, ATTENTION_ROWS, contribution_rows, forward),
                align_rows(residual, ATTENTION_ROWS, rows, forward),
                update,
                owed_sum=owed_sum,
                transform=transform,
                rows=rows,
                contribution_rows=contribution_rows,
            )
        forward.residual_stream = stream
        return handle

    # facts ------------------------------------------------------------------------------------
    @property
    def fusions(self):
        return self.plan.fusions

    @property
    def label(self) -> str:
        return self.plan.label

    def describe(self) -> dict:
        return self.plan.describe()

    def __repr__(self) -> str:
        return f"StageBoundary({self.plan.label}: {self.declaration.describe()})"


class PublishingStageBoundary(StageBoundary):
    """A stage with row adapters (`publish_rows=`): every `prepare()` also publishes the rows its
    compute input holds, so plain stages pay nothing for the feature."""

    __slots__ = ()

    def prepare(self, hidden_states, forward, *, capture_output=None, captured_last_layer_outputs=None):
        inp = super().prepare(
            hidden_states, forward, capture_output=capture_output, captured_last_layer_outputs=captured_last_layer_outputs
        )
        publish_rows(self.plan, forward)
        return inp


def build_boundaries(items, *, parallel, policy, label: str, registry=None, two_batch_overlap: bool = False) -> tuple[StageBoundary, ...]:
    """The boundaries of locally connected stages, from their plans (`plan_stages`)."""
    registry = registry if registry is not None else get_registry()
    plans = plan_stages(items, parallel=parallel, policy=policy, label=label, registry=registry, two_batch_overlap=two_batch_overlap)
    return tuple((PublishingStageBoundary if p.row_publishers else StageBoundary)(p) for p in plans)


def boundaries_of(model) -> list[StageBoundary]:
    """Every StageBoundary held by a module tree, in module order, each once."""
    seen: set[int] = set()
    out: list[StageBoundary] = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, StageBoundary) and id(value) not in seen:
                seen.add(id(value))
                out.append(value)
    return out
