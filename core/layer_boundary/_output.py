"""Values that still owe work, and output transforms.

These are plain `__slots__` classes (not attrs): they are created on every forward and must be
cheap, and tracing tools handle plain classes best.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["OutputTransform", "UnreducedOutput", "HandoffOutput"]


class OutputTransform:
    """Processing of a producer's contribution before the residual update (a sandwich norm, a scale).

    It runs after the sum completes, which turns off reduce-scatter and deferral for that
    output, unless `before_reduce_scatter` says the implementation is row-wise and may run on
    each rank's share before a reduce-scatter (never before an all-reduce of partials).

    A transform that is one of the core's norms (`RMSNorm`, `GemmaRMSNorm`, `LayerNorm` or a
    subclass) is a *post-norm* (`post_norm` is that module): the sum and the norm stay deferrable,
    and the next input completes them together with its add and its own read, in one call a
    fusion provider may fuse.
    """

    __slots__ = ("apply", "before_reduce_scatter", "name", "post_norm")

    def __init__(self, apply: Callable[[torch.Tensor], torch.Tensor], *, before_reduce_scatter: bool = False, name: str = ""):
        if not callable(apply):
            raise TypeError("OutputTransform needs a callable")
        from ._residual.add_norm import has_add_norm

        self.apply = apply
        self.before_reduce_scatter = before_reduce_scatter
        self.name = name or getattr(apply, "__name__", type(apply).__name__)
        #: the norm module this transform is, or None (any other callable)
        self.post_norm = apply if has_add_norm(apply) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x)

    def __repr__(self) -> str:
        return f"OutputTransform({self.name})"


class UnreducedOutput:
    """A partial sum that a later step completes over `group`.

    `declared` marks a sum the producer's contract always leaves (attention's PARTIAL output):
    it survives a pipeline handoff for the receiver to complete. A dynamic deferral
    (`declared=False`) is completed before any handoff.
    """

    __slots__ = ("partial", "group", "sum_group", "declared")

    def __init__(self, partial: torch.Tensor, group, sum_group, *, declared: bool):
        self.partial = partial
        self.group = group
        self.sum_group = sum_group
        self.declared = declared

    def complete(self) -> torch.Tensor:
        return self.group.all_reduce(self.partial)

    @property
    def rows(self) -> int:
        return self.partial.shape[0]

    def __repr__(self) -> str:
        kind = "declared" if self.declared else "deferred"
        return f"UnreducedOutput({kind} sum over {self.sum_group.name}, rows={self.rows})"


class HandoffOutput:
    """Producer-specific deferred work, such as an unfinalized MoE output.

    Subclasses hold what a fused consumer needs and implement `complete()`, the producer's own
    unfused path (finalize and sum), which the boundary runs when no fused consumer takes it.
    """

    #: the sum group a fused consumer completes together with the finalize
    sum_group = None
    group = None

    def complete(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement complete()")

    @property
    def rows(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

