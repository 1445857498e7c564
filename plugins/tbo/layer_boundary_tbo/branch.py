"""Prepared branches: stages that start from an input another stage already read.

LongCat-Flash reads its post-attention residual once and feeds the normalized input both to the
MoE (the main line) and to a shortcut of dense FFN -> attention -> dense FFN (the branch):

    r0 = residual after the first attention, x = norm(r0)
    main line:  m  = MoE(x)
    branch:     r1 = r0 + ffn0(x); r2 = r1 + attn1(norm r1); r3 = r2 + ffn1(norm r2)
    merged:     r3 + m

`branch_input` moves the prepared input to the branch's rows and hands the residual to a new
stream on a child Forward; the main line keeps only its pending output, and its residual slot
holds a marker that fails loudly if anything reads it before the merge. `branch_output`
completes the branch's last contribution on the handoff rows and applies its update (r3); it
releases the branch's stream. `merge_branch` puts r3 under the main line's output, which stays
pending with the main line's update, so the next stage adds it exactly as the unsplit layer does
((r2 + ffn1) + m, the same rounding as Hugging Face's layer), a sum the main line still owes may
fuse into the next input, and the residual is added exactly once. The main line's update must be
a plain add (the branch's residual replaces the one it would have updated).

Branch transport uses ordinary token rows only: construction rejects context parallel, and a
branch plan has no sequence-parallel or input-scattered path.
"""

from __future__ import annotations

from layer_boundary import Messages as CoreMessages, ResidualStream, RowLayout, StageKind
from layer_boundary.plugin import align_rows, dp_gather, dp_scatter

from .messages import Messages

__all__ = ["BranchAdapter", "BranchOutput", "ForkedResidual"]

ATTENTION_ROWS = RowLayout.DP_LOCAL


class ForkedResidual:
    """Marks a main-line stream whose residual moved into a branch; any use of it raises."""

    __slots__ = ("branch", "label")

    def __init__(self, branch: ResidualStream, label: str):
        self.branch = branch
        self.label = label

    def _fail(self, *args, **kwargs):
        raise RuntimeError(Messages.FORKED.format(label=self.label))

    def __getattr__(self, item):
        if item.startswith("__"):  # protocol probes (a tracer's, copy's) get Python's answer
            raise AttributeError(item)
        self._fail()

    __getitem__ = __add__ = __radd__ = __mul__ = __rmul__ = __len__ = __iter__ = _fail

    def __repr__(self) -> str:
        return f"ForkedResidual(into the branch at {self.label})"


class BranchOutput:
    """A branch's result on the handoff rows: its residual with its last contribution applied."""

    __slots__ = ("residual", "origin")

    def __init__(self, residual, origin: ResidualStream):
        self.residual = residual
        self.origin = origin

    def __repr__(self) -> str:
        return "BranchOutput()"


def _input_rows(declaration, topology) -> RowLayout:
    # The rows a stage computes on in the ordinary variant: an FFN gathers over attention DP
    # (full rows), everything else computes on its rank's attention rows.
    return RowLayout.DP_GATHERED if declaration.kind is StageKind.FFN and topology.attn_dp > 1 else ATTENTION_ROWS


def _stream(forward):
    stream = forward.residual_stream
    if stream is None:
        raise RuntimeError(CoreMessages.NOT_STARTED)
    return stream


class BranchAdapter:
    """The "branch" adapter: `branch_input`, `branch_output` and `merge_branch`."""

    def branch_input(self, boundary, hidden_states, forward):
        plan = boundary.plan
        if not plan.is_branch:
            raise ValueError(
                f"stage {plan.label} is not a prepared branch (it was built without prepared_from=); enter it with prepare()"
            )
        plan.path_for(forward)  # a branch has ordinary rows only: other variants raise here
        stream = _stream(forward)
        residual = stream.residual
        if isinstance(residual, ForkedResidual):
            raise RuntimeError(
                f"branch_input at stage {plan.label}: this batch's residual already moved into the branch at "
                f"{residual.label}; merge that branch first"
            )
        if residual is None:
            raise RuntimeError(
                f"branch_input at stage {plan.label} needs the input its source stage prepared: call the source stage's "
                "prepare() on this Forward first"
            )
        source = plan.declaration.prepared_from
        if not source.update.plain_add:
            raise NotImplementedError(
                f"branch at stage {plan.label}: the merge adds the main line's output over the branch's residual, which "
                f"needs a plain-add update on the main line; got {source.update!r}"
            )
        topology = plan.parallel.topology
        moves = (_input_rows(source, topology), _input_rows(plan.declaration, topology))
        if moves == (RowLayout.DP_GATHERED, ATTENTION_ROWS):
            hidden_states = dp_scatter(hidden_states, forward)
        elif moves == (ATTENTION_ROWS, RowLayout.DP_GATHERED):
            hidden_states = dp_gather(hidden_states, forward)
        branch = ResidualStream()
        branch.write(align_rows(residual, stream.rows, ATTENTION_ROWS, forward), ATTENTION_ROWS)
        child = forward.child(forward.num_tokens, dp_counts=forward.dp_counts, microbatch=forward.microbatch)
        child.residual_stream = branch
        stream.residual = ForkedResidual(branch, plan.label)
        return hidden_states, child

    def branch_output(self, hidden_states, branch_forward) -> BranchOutput:
        stream = branch_forward.residual_stream
        if stream is None:
            raise RuntimeError("branch_output: this Forward has no branch stream; pass the Forward branch_input returned, once")
        _, pending, residual = stream.receive(hidden_states)
        if pending is None:
            raise RuntimeError("branch_output takes the output of the branch's last stage (after its finish()), not a written stream")
        value = align_rows(pending.complete(), pending.rows, stream.rows, branch_forward)
        residual = pending.update.apply(value, residual)
        branch_forward.residual_stream = None
        return BranchOutput(align_rows(residual, stream.rows, ATTENTION_ROWS, branch_forward), stream)

    def merge_branch(self, hidden_states, branch: BranchOutput, forward):
        if not isinstance(branch, BranchOutput):
            raise TypeError(f"merge_branch takes the result of branch_output(), got {type(branch).__name__}")
        stream = _stream(forward)
        forked = stream.residual
        if not isinstance(forked, ForkedResidual) or forked.branch is not branch.origin:
            raise RuntimeError(
                "merge_branch: this branch was not entered from this Forward's current stage; merge each branch into the "
                "Forward it was entered from, once"
            )
        stream.check(hidden_states)
        if stream.pending is None:
            raise RuntimeError("merge_branch needs the main line's output: finish the source stage's exit first")
        stream.residual = branch.residual
        stream.rows = ATTENTION_ROWS
        return hidden_states
