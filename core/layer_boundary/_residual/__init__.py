"""The residual algebra: how a producer updates the residual and how a consumer reads it.

A producer owns a `StageUpdate`; a consumer owns a `StageRead` and its norm. The update travels
with the producer's contribution in the residual stream, so the consumer applies exactly the
update the producer declared. Capability flags tell the planner which orderings are valid:

- `StageUpdate.plain_add`: update(c, r) == c + r. Allows fused add+norm kernels and adding the
  residual on one rank before a sum completes. A nonlinear update (MHC's post/comb mix) must see
  the completed sum first.
- `StageUpdate.at_producer`: apply at the producer's exit; the stream is written there.
- `StageUpdate.outlives_layer`: the update may wait for the next layer's input (deferral).
- `StageRead.plain_norm`: read(r) == norm(r); with a plain add, fused kernels may take over.
- `StageRead.before_gather`: the read runs on the source rows before an attention-DP gather.

Residual values are tensors or tuples of tensors sharing dim 0 (the token rows); the boundary
only moves rows, never looks inside.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import attrs

__all__ = [
    "StageUpdate",
    "StageRead",
    "ResidualOps",
    "residual_kind",
    "UPDATE_FLAGS",
    "READ_FLAGS",
]

UPDATE_FLAGS = ("plain_add", "at_producer", "outlives_layer")
READ_FLAGS = ("plain_norm", "before_gather")


@runtime_checkable
class StageUpdate(Protocol):
    plain_add: bool
    at_producer: bool
    outlives_layer: bool

    def apply(self, contribution: Any, residual: Any) -> Any:
        """The new residual from the producer's complete contribution and the old residual."""


@runtime_checkable
class StageRead(Protocol):
    plain_norm: bool
    before_gather: bool

    def enter(self, hidden: Any) -> Any:
        """The residual at stack entry (the embedding, or an expansion of it)."""

    def read(self, residual: Any, norm: Any) -> tuple[Any, Any]:
        """(compute input, residual) without an update."""

    def update_and_read(self, update: StageUpdate, contribution: Any, residual: Any, norm: Any) -> tuple[Any, Any]:
        """Apply the producer's update, then read; may fuse the two."""


def check_capabilities(obj: Any, flags: tuple[str, ...], role: str) -> None:
    missing = [f for f in flags if not isinstance(getattr(obj, f, None), bool)]
    if missing:
        raise TypeError(f"{type(obj).__name__} does not set {', '.join(missing)}, which every {role} must")


@attrs.frozen(kw_only=True)
class ResidualOps:
    """A residual kind's four operations: what attention and FFN stages read and write."""

    name: str
    attn_read: Any
    attn_update: Any
    ffn_read: Any
    ffn_update: Any
    #: stages may run on attention-TP slices (sequence parallel / input scattered)
    supports_slices: bool = True
    #: a final-norm read for the stack exit, or None for update-then-norm
    final_read: Optional[Any] = None

    def __attrs_post_init__(self):
        for read in (self.attn_read, self.ffn_read):
            check_capabilities(read, READ_FLAGS, "StageRead")
        for update in (self.attn_update, self.ffn_update):
            check_capabilities(update, UPDATE_FLAGS, "StageUpdate")


def residual_kind(kind: str, **options) -> ResidualOps:
    """The residual semantics registered under `kind`, built with `options`.

    The first record of that kind (in the selection order) whose factory accepts the options
    wins. A kind no installed plugin provides raises an error naming the distribution to install.
    """
    from .._errors import missing_feature
    from .._plugins.manager import get_registry
    from .._plugins.selection import select

    candidates = get_registry().residual_kinds_of(kind)
    if not candidates:
        raise missing_feature(f"residual kind {kind!r}", kind)
    chosen = select("residual_kinds", kwargs=options, records=candidates, subject=f"building residual kind {kind!r}",
                    check=ResidualOps, error_type=None)
    if chosen.chosen is None:
        reasons = "; ".join(f"{a.candidate}: {a.reason}" for a in chosen.declined)
        raise NotImplementedError(f"no installed residual kind {kind!r} takes these options ({reasons})")
    return chosen.value
