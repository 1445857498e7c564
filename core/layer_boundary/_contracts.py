"""Declarations' vocabulary and the frozen descriptions handed to plugins.

Nothing here holds a tensor: these values are built once at model construction.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional

import attrs

from ._layout import SumGroup

__all__ = [
    "ProducerReduction",
    "StageKind",
    "ReductionPolicy",
    "FusedMlpInput",
    "StageDescription",
]


class ProducerReduction(enum.Enum):
    """How a producer's compute cooperates with the boundary's reduction decision."""

    #: attention only: compute always returns a contribution that still needs its sum
    PARTIAL = "partial"
    #: compute obeys the exit's decision (FFN default; a single-stage mixer)
    SCOPED = "scoped"
    #: FFN only: compute adds a replicated component after its internal sum; never deferred
    LOCAL_TAIL = "local_tail"

    def __repr__(self) -> str:
        return self.name


class StageKind(enum.Enum):
    ATTENTION = "attention"
    MIXER = "mixer"  #: a token mixer declared with declare_attn(reduction=SCOPED)
    FFN = "ffn"

    def __repr__(self) -> str:
        return self.name


class ReductionPolicy(enum.Enum):
    """Permissions for optional FFN output transport (never commands)."""

    AR = "ar"
    RS = "rs"
    RSV = "rsv"
    RS_RSV = "rs+rsv"
    AUTO = "auto"

    @property
    def allows_rs(self) -> bool:
        return self in (ReductionPolicy.RS, ReductionPolicy.RS_RSV)

    @property
    def allows_rsv(self) -> bool:
        return self in (ReductionPolicy.RSV, ReductionPolicy.RS_RSV)


@attrs.frozen(kw_only=True)
class FusedMlpInput:
    """A consumer candidate that completes an owed value together with the add + norm.

    `run(owed, residual, forward)` receives the owed value (an `UnreducedOutput` whose sum
    runs over `completes`, or a `HandoffOutput` when `handoff=True`) and returns
    `(compute_input, new_residual)`, or None, before touching anything, to decline.
    `preserves_residual` says the candidate never writes the old residual in place.
    `output_format` is what it returns as compute input: "plain" (the normalized tensor), or a
    quantized format ("fp8_static", "fp8_dynamic"); a read is offered only candidates of its own.
    `norm_kinds` are the read norms it computes (`StageDescription.norm_kind`: the RMSNorm kinds
    by default; "layer", "none" for an identity read). `post_norm_kinds` are the output norms it
    applies to the completed sum before the add (`StageDescription.post_norm_kind`); empty (the
    default): it takes no post-norm, and is offered only where none arrives. A stage is offered
    only the candidates of its own kinds.
    """

    run: Callable[..., Any]
    completes: Optional[SumGroup] = None
    handoff: bool = False
    name: str = ""
    preserves_residual: bool = False
    output_format: str = "plain"
    norm_kinds: tuple = ("rms", "gemma_rms")
    post_norm_kinds: tuple = ()
    #: set by the core for its own last-resort candidate, which never declines
    always: bool = False


@attrs.frozen(kw_only=True)
class StageDescription:
    """What a fusion provider's factory may look at to decide whether it applies."""

    kind: StageKind
    label: str
    sparse: bool
    terminal: bool
    enters_stack: bool
    topology: Any
    #: the sum an arriving output may owe at this stage's input (None when it never owes one)
    incoming_sum: Optional[SumGroup]
    #: the arriving update is a plain add
    plain_update: bool
    #: this stage's read is a plain norm
    plain_read: bool
    #: "rms", "gemma_rms", "layer" (the core's LayerNorm), "none" (a read that normalizes
    #: nothing: the identity) or "other"
    norm_kind: str
    hidden_size: Optional[int]
    eps: Optional[float]
    residual: str
    reduction: ReductionPolicy
    #: the output sum group this stage's own output owes (None when always complete)
    output_sum: Optional[SumGroup]
    #: what the read hands compute: "plain" (a normalized tensor), a quantized format
    #: ("fp8_static", "fp8_dynamic"), or None for a read no fused candidate can stand in for
    read_format: Optional[str] = "plain"
    #: the kind of the output norm ("rms", "gemma_rms", "layer", "other") an arriving output owes
    #: before its add (a post-norm or sandwich layer, `OutputTransform(norm)`), which this input
    #: completes with its sum, its add and its read; None where none arrives
    post_norm_kind: Optional[str] = None
