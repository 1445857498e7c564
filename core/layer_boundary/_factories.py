"""Model-facing declarations and the factories that turn them into stage boundaries.

A model declares each stage's compute facts once (`declare_attn`, `declare_ffn`) and assembles
the stages of a layer with `make_stages`, naming the real neighbours outside the call
(`previous`, `following`) and whether the call ends the stack (`terminal`). Construction
resolves every supported batch variant into bound paths; impossible combinations fail here,
never mid-forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

import attrs

from ._errors import Messages
from ._contracts import ProducerReduction, ReductionPolicy, StageKind
from ._output import OutputTransform
from ._residual import READ_FLAGS, UPDATE_FLAGS, ResidualOps, check_capabilities
from ._residual.add_norm import PLAIN_RESIDUAL

__all__ = [
    "StageDeclaration",
    "declare_attn",
    "declare_ffn",
    "make_stages",
    "make_attn_stage",
    "make_ffn_stage",
    "layer_stack",
    "LayerStack",
    "ATTENTION_OPTIONS",
    "FFN_OPTIONS",
]

ATTENTION_OPTIONS = frozenset({"qkv_latent_func", "fusions", "publish_rows", "producer"})
#: the guide's FFN options are `fusions` only; `publish_rows` is this library's one addition (`_WHY_MORE`)
FFN_OPTIONS = frozenset({"fusions", "publish_rows"})
_OPTIONS_NOTE = {
    "attention": "an attention stage takes qkv_latent_func and fusions (the guide's options), publish_rows, and producer (the "
    "module computing its output, checked at construction for a projection that reduces itself)",
    "mixer": "a mixer stage takes qkv_latent_func and fusions (the guide's options), publish_rows and producer",
    "ffn": "an FFN stage takes fusions (the guide's only FFN option) and publish_rows",
}
_WHY_MORE = (
    "; publish_rows=(kind, ...) is this library's addition: row publishers such as layer-boundary-lora's are told which "
    "rows the compute input holds, which the guide's adapters read from engine globals"
)


@attrs.frozen(kw_only=True, eq=False)
class StageDeclaration:
    """A stage's compute facts: its read and update, reduction cooperation and neighbours.

    It owns no norm and no plan. `previous` / `prepared_from` / `terminal` / `following` are
    filled in by the assembler (`make_stages`) or given to `make_attn_stage` /
    `make_ffn_stage`.
    """

    kind: StageKind
    reduction: ProducerReduction
    read: Any
    update: Any
    residual: str = "core.plain"
    residual_ops: Optional[ResidualOps] = None
    sparse: bool = False
    next_sparse: bool = False
    gathers_tp_input: bool = True
    #: an attention/mixer compute that takes this rank's context-parallel rows and exchanges
    #: what it needs itself (`Forward.cp`); otherwise a CP batch gathers its input to full rows
    takes_cp_shard: bool = False
    output_transform: Optional[OutputTransform] = None
    #: an FFN that runs beside the attention before it (`h + attn(n1(h)) + mlp(n2(h))`): it reads
    #: the residual that attention read, and its output joins the attention's owed sum
    parallel_residual: bool = False
    previous: Optional["StageDeclaration"] = None
    prepared_from: Optional["StageDeclaration"] = None
    following: Optional["StageDeclaration"] = None
    terminal: bool = False
    #: the label of the stage built from this declaration (set by planning; None for a
    #: declaration no stage was built from), so `prepared_from=` can name a real stage
    built_as: Optional[str] = None

    def __attrs_post_init__(self):
        check_capabilities(self.read, READ_FLAGS, "StageRead")
        check_capabilities(self.update, UPDATE_FLAGS, "StageUpdate")
        if self.previous is not None and self.prepared_from is not None:
            raise ValueError("choose a previous output or a prepared branch input")
        for source in (self.previous, self.prepared_from, self.following):
            if source is not None and not isinstance(source, StageDeclaration):
                raise TypeError("stage sources must be declarations")

    @property
    def is_attention_like(self) -> bool:
        return self.kind in (StageKind.ATTENTION, StageKind.MIXER)

    def facts(self) -> tuple:
        """What a neighbour may rely on: compared when two calls describe the same edge."""
        return (
            self.kind,
            self.reduction,
            self.sparse,
            self.next_sparse,
            self.residual,
            tuple(getattr(self.update, f) for f in UPDATE_FLAGS),
            tuple(getattr(self.read, f) for f in READ_FLAGS),
            self.output_transform is not None,
            self.parallel_residual,
        )

    def describe(self) -> str:
        name = self.kind.value
        extras = []
        if self.kind is StageKind.FFN and self.sparse:
            extras.append("sparse")
        if self.kind is StageKind.FFN and self.next_sparse:
            extras.append("next_sparse")
        if self.reduction is ProducerReduction.LOCAL_TAIL:
            extras.append("local_tail")
        if self.residual != "core.plain":
            extras.append(self.residual)
        if self.parallel_residual:
            extras.append("parallel_residual")
        return name + (f"[{','.join(extras)}]" if extras else "")


def _ops(residual: Optional[ResidualOps]) -> ResidualOps:
    if residual is None:
        return PLAIN_RESIDUAL
    if not isinstance(residual, ResidualOps):
        raise TypeError(f"residual must be a ResidualOps (from residual_kind(...)), got {type(residual).__name__}")
    return residual


def _declaration(kind: StageKind, reduction, residual, read, update, output_transform, **facts) -> StageDeclaration:
    """A stage of `kind` on the residual kind `residual` (plain when None); `read` and `update`
    default to that kind's for the stage's role (an FFN's, or an attention's and a mixer's)."""
    ops = _ops(residual)
    ffn = kind is StageKind.FFN
    return StageDeclaration(
        kind=kind,
        reduction=reduction,
        read=(ops.ffn_read if ffn else ops.attn_read) if read is None else read,
        update=(ops.ffn_update if ffn else ops.attn_update) if update is None else update,
        residual=ops.name,
        residual_ops=ops,
        output_transform=output_transform,
        **facts,
    )


def declare_attn(
    *,
    reduction: ProducerReduction = ProducerReduction.PARTIAL,
    residual: Optional[ResidualOps] = None,
    read=None,
    update=None,
    gathers_tp_input: bool = True,
    takes_cp_shard: bool = False,
    output_transform: Optional[OutputTransform] = None,
) -> StageDeclaration:
    """An attention stage (PARTIAL: always leaves its attention-TP sum) or, with
    `reduction=SCOPED`, a single-stage token mixer that obeys its exit's decision.

    `gathers_tp_input=False` says the compute cannot take input gathered over attention TP, so
    the stage has no sequence-parallel or input-scattered path. `takes_cp_shard=True` says that
    under an active context-parallel batch the compute runs on this rank's CP rows and fetches
    the other rows' keys and values itself (through `Forward.cp`), even when it has no rows;
    otherwise the CP adapter gathers its input to full rows first.
    """
    reduction = ProducerReduction(reduction)
    if reduction is ProducerReduction.LOCAL_TAIL:
        raise ValueError(Messages.LOCAL_TAIL_ATTN)
    kind = StageKind.ATTENTION if reduction is ProducerReduction.PARTIAL else StageKind.MIXER
    return _declaration(
        kind, reduction, residual, read, update, output_transform, gathers_tp_input=gathers_tp_input, takes_cp_shard=takes_cp_shard
    )


def declare_ffn(
    *,
    reduction: ProducerReduction = ProducerReduction.SCOPED,
    sparse: bool = False,
    next_sparse: bool = False,
    residual: Optional[ResidualOps] = None,
    read=None,
    update=None,
    output_transform: Optional[OutputTransform] = None,
    parallel_residual: bool = False,
) -> StageDeclaration:
    """An FFN stage (dense, or `sparse=True` for MoE). `next_sparse` describes the next layer's
    FFN, from which two-batch-overlap handoff rows derive.

    `parallel_residual=True` declares the FFN a parallel branch of the attention before it
    (GPT-NeoX's `use_parallel_residual`, Cohere: `h + attn(n1(h)) + mlp(n2(h))`): its input is
    its norm of the residual the attention read, and the attention's partial output joins this
    FFN's partial output, so one sum completes both. Construction refuses, naming the stage, a
    parallel FFN without an attention right before it, a MoE or LOCAL_TAIL one, an update on
    either stage that is not a plain add left for the next input, an output transform on either,
    a read that is not a (quantizing) norm read, and context parallel.
    """
    reduction = ProducerReduction(reduction)
    if reduction is ProducerReduction.PARTIAL:
        raise ValueError(Messages.PARTIAL_FFN)
    return _declaration(StageKind.FFN, reduction, residual, read, update, output_transform, sparse=sparse, next_sparse=next_sparse,
                        parallel_residual=bool(parallel_residual))


# ---------------------------------------------------------------------------------------------
# construction context
# ---------------------------------------------------------------------------------------------


class LayerStack:
    """Construction context: the topology and resolved policy, and neighbour checks.

    Stages built in one `layer_stack` are checked against each other as they are made: a call's
    `previous` must describe the stage the call before it ended with, and that call's
    `following` (when given) must describe this call's first stage.
    """

    def __init__(self, parallel, reduction, two_batch_overlap: bool = False):
        from ._policy import require_resolved

        self.parallel = parallel
        self.reduction = require_resolved(reduction)
        self.two_batch_overlap = bool(two_batch_overlap)
        self.last: Optional[StageDeclaration] = None
        self.last_following: Optional[StageDeclaration] = None
        self.ended = False
        self.count = 0
        #: the declarations of every stage built in this stack (branches included)
        self.built: list[StageDeclaration] = []

    def admit(self, first: StageDeclaration, previous, last: StageDeclaration, following, terminal: bool) -> None:
        label = f"stage call {self.count}"
        if previous is None and self.last is not None and not self.ended:
            raise ValueError(
                f"{label} starts a new stack (previous=None) but the stack before it did not end; pass "
                "previous= the declaration of the stage before, or mark the last stage terminal=True"
            )
        if previous is not None and self.ended:
            raise ValueError(
                f"{label} declares previous={previous.describe()} right after a terminal stage: terminal=True marks the end "
                "of the model's stack, so set it only on the last layer (a pipeline rank with layers downstream is not "
                "terminal); a NextN/MTP module is its own stack and enters with previous=None"
            )
        if previous is not None and self.last is not None:
            if previous.facts() != self.last.facts():
                raise ValueError(
                    f"{label}: previous={previous.describe()} does not describe the stage built before it "
                    f"({self.last.describe()}); both neighbours must describe the same edge"
                )
            if self.last_following is not None and self.last_following.facts() != first.facts():
                raise ValueError(
                    f"{label}: the stage before declared following={self.last_following.describe()}, but this call "
                    f"starts with {first.describe()}; both neighbours must describe the same edge"
                )
        self.last = last
        self.last_following = following
        self.ended = terminal
        self.count += 1

    def check_source(self, prepared_from: StageDeclaration) -> None:
        """A branch's `prepared_from` must be a stage built in this stack."""
        if not any(d is prepared_from for d in self.built):
            raise ValueError(
                f"prepared_from= names stage {prepared_from.built_as}, which was not built in this layer stack; a branch "
                "reuses the input its source stage prepared in the same forward, so the source belongs to the same stack"
            )


_STACK: contextvars.ContextVar[Optional[LayerStack]] = contextvars.ContextVar("layer_boundary_stack", default=None)


@contextlib.contextmanager
def layer_stack(parallel, *, reduction="ar", two_batch_overlap: bool = False) -> Iterator[LayerStack]:
    """Build a model's stages inside this block: they share `parallel` and the reduction policy.

    `reduction` must already be resolved (`resolve_reduction("auto", config)` gives the
    per-architecture default). `two_batch_overlap=True` says the engine runs this model with
    two-batch overlap, which may split a batch where a dense layer meets a sparse one: the FFN
    declared `declare_ffn(sparse=False, next_sparse=True)` then hands on a complete output on
    attention rows, the rows the split cuts (see `tbo_split_point`).
    """
    stack = LayerStack(parallel, reduction, two_batch_overlap)
    token = _STACK.set(stack)
    try:
        yield stack
    finally:
        _STACK.reset(token)


def _context(parallel, reduction) -> tuple[Any, ReductionPolicy, Optional[LayerStack]]:
    stack = _STACK.get()
    if parallel is None:
        if stack is None:
            raise RuntimeError(
                "no topology for these stages: build them inside `with layer_stack(parallel, reduction=...)` "
                "or pass parallel= and reduction="
            )
        parallel = stack.parallel
    if reduction is None:
        reduction = stack.reduction if stack is not None else "ar"
    from ._policy import require_resolved

    return parallel, require_resolved(reduction), stack


# ---------------------------------------------------------------------------------------------
# assemblers
# ---------------------------------------------------------------------------------------------


def _split_item(item) -> tuple[StageDeclaration, Any, dict]:
    if not isinstance(item, tuple) or len(item) not in (2, 3):
        raise TypeError("a stage needs (declaration, norm[, options])")
    decl, norm = item[0], item[1]
    options = dict(item[2]) if len(item) == 3 and item[2] is not None else {}
    if not isinstance(decl, StageDeclaration):
        raise TypeError("make_stages requires stage declarations")
    if decl.previous is not None or decl.prepared_from is not None:
        raise ValueError("a declaration passed to make_stages takes its source from make_stages (previous= or prepared_from=)")
    if decl.terminal:
        raise ValueError("a declaration passed to make_stages takes terminal from make_stages (terminal=)")
    if decl.following is not None:
        raise ValueError("a declaration passed to make_stages takes following from make_stages (following=)")
    _check_options(decl, options)
    return decl, norm, options


def _check_options(decl: StageDeclaration, options) -> None:
    allowed = ATTENTION_OPTIONS if decl.is_attention_like else FFN_OPTIONS
    unknown = sorted(set(options or ()) - allowed)
    if unknown:
        raise TypeError(f"unsupported {decl.kind.value} stage options: {unknown}; {_OPTIONS_NOTE[decl.kind.value]}{_WHY_MORE}")
    producer = (options or {}).get("producer")
    if producer is not None and decl.kind is StageKind.ATTENTION and decl.reduction is ProducerReduction.PARTIAL:
        from ._layers import check_partial_producer

        check_partial_producer(producer, stage=f"this {decl.describe()} stage")


def make_stages(
    *items,
    previous: Optional[StageDeclaration] = None,
    following: Optional[StageDeclaration] = None,
    terminal: bool = False,
    prepared_from: Optional[StageDeclaration] = None,
    parallel=None,
    reduction=None,
    label: Optional[str] = None,
    two_batch_overlap: Optional[bool] = None,
):
    """Connect local stages in order and return one `StageBoundary` per item.

    Each item is `(declaration, norm)` or `(declaration, norm, options)`. `previous` describes
    the real producer before the first item (None only where the stack starts); `following`
    the consumer after the last; `terminal=True` when the last item ends the model's stack.
    `prepared_from` starts a branch from another stage's already-read input: the declaration of
    that stage's boundary (`boundary.declaration`), built in the same stack.
    `two_batch_overlap` defaults to the enclosing `layer_stack`'s.
    """
    if not items:
        raise ValueError("make_stages needs at least one stage")
    if previous is not None and prepared_from is not None:
        raise ValueError("choose a previous output or a prepared branch input")
    for source in (previous, following, prepared_from):
        if source is not None and not isinstance(source, StageDeclaration):
            raise TypeError("stage sources must be declarations")
    split = [_split_item(item) for item in items]
    resolved: list[StageDeclaration] = []
    for i, (decl, _, _) in enumerate(split):
        is_last = i == len(split) - 1
        source_prev = resolved[i - 1] if i else previous
        source_branch = prepared_from if i == 0 else None
        nxt = split[i + 1][0] if not is_last else following
        resolved.append(
            attrs.evolve(
                decl,
                previous=source_prev,
                prepared_from=source_branch,
                following=nxt,
                terminal=terminal and is_last,
            )
        )
    if terminal and following is not None:
        raise ValueError("a terminal stage has no following stage; drop following= or terminal=True")
    return _assemble([(d, norm, opts) for d, (_, norm, opts) in zip(resolved, split)], parallel, reduction, label,
                     two_batch_overlap, default_label=None)


def _assemble(items, parallel, reduction, label, two_batch_overlap, *, default_label):
    """Check a call's resolved `(declaration, norm, options)` items against their neighbours and
    the enclosing stack, and build their boundaries. The checks of the integration checklist
    live here, so `make_stages` and the single-stage factories enforce the same rules."""
    from ._stage import build_boundaries

    first, last = items[0][0], items[-1][0]
    _check_edges(first, last)
    parallel, policy, stack = _context(parallel, reduction)
    source = first.prepared_from
    if source is not None:  # a branch is a side line, not the stack's chain
        if source.built_as is None:
            raise ValueError(
                f"prepared_from={source.describe()} is a new declaration, not a built stage's: pass the declaration of the "
                "boundary whose prepared input the branch reuses (for example prepared_from=moe_boundary.declaration)"
            )
        if stack is not None:
            stack.check_source(source)
    elif stack is not None:
        stack.admit(first, first.previous, last, last.following, last.terminal)
    if two_batch_overlap is None:
        two_batch_overlap = stack.two_batch_overlap if stack is not None else False
    if label is None:
        label = default_label or (f"call{stack.count - 1}" if stack is not None else "stages")
    boundaries = build_boundaries(items, parallel=parallel, policy=policy, label=label, two_batch_overlap=bool(two_batch_overlap))
    if stack is not None:
        stack.built.extend(b.declaration for b in boundaries)
    return boundaries


def _check_edges(first: StageDeclaration, last: StageDeclaration) -> None:
    """A neighbour declaration that itself names its neighbour must name the local stage: both
    sides of an edge (even on two pipeline ranks) describe it the same way. A terminal stage
    ends the stack: nothing names it as its previous."""
    following, previous = last.following, first.previous
    if following is not None and following.previous is not None and following.previous.facts() != last.facts():
        raise ValueError(
            f"following={following.describe()} names a previous stage ({following.previous.describe()}) that is not "
            f"this {last.describe()} stage"
        )
    if previous is not None and previous.following is not None and previous.following.facts() != first.facts():
        raise ValueError(
            f"previous={previous.describe()} names a following stage ({previous.following.describe()}) that is not "
            f"this {first.describe()} stage"
        )
    if previous is not None and previous.terminal:
        raise ValueError(
            f"previous={previous.describe()} is a terminal stage: terminal=True marks the end of the model's stack, so no "
            "stage follows it; set terminal only on the last layer, and enter a NextN/MTP module (its own stack) with "
            "previous=None"
        )


def _single(declaration: StageDeclaration, norm, options, parallel, reduction, label, two_batch_overlap):
    following = declaration.following
    if following is not None and following.previous is None:
        raise ValueError(
            f"following={following.describe()} must name this {declaration.describe()} stage in its previous= field: a "
            "single stage's following declaration describes the local consumer, which names its producer "
            "(attrs.evolve(following, previous=declaration) or the consumer's own declaration)"
        )
    (boundary,) = _assemble([(declaration, norm, dict(options or {}))], parallel, reduction, label, two_batch_overlap,
                            default_label="stage")
    return boundary


def make_attn_stage(declaration: StageDeclaration, norm, options: Optional[dict] = None, *, parallel=None, reduction=None, label=None,
                    two_batch_overlap: Optional[bool] = None):
    """One independently constructed attention or mixer stage; the declaration carries its
    source (`previous`/`prepared_from`), `following` (whose own `previous` names this stage)
    and `terminal`."""
    if not declaration.is_attention_like:
        raise TypeError("make_attn_stage needs an attention declaration (declare_attn)")
    _check_options(declaration, options)
    return _single(declaration, norm, options, parallel, reduction, label, two_batch_overlap)


def make_ffn_stage(declaration: StageDeclaration, norm, options: Optional[dict] = None, *, parallel=None, reduction=None, label=None,
                   two_batch_overlap: Optional[bool] = None):
    """One independently constructed FFN stage (see `make_attn_stage`)."""
    if declaration.kind is not StageKind.FFN:
        raise TypeError("make_ffn_stage needs an FFN declaration (declare_ffn)")
    _check_options(declaration, options)
    return _single(declaration, norm, options, parallel, reduction, label, two_batch_overlap)
