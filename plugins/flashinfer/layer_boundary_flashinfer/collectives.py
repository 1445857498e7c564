"""FlashInfer's plain all-reduce as a model's custom all-reduce: every sum the boundaries leave
unfused (a terminal FFN's sum before the final norm, a stage FlashInfer's fused kernels do not
take) runs as one kernel on the fusion workspace instead of a process-group call.

    parallel = flashinfer_collectives(Parallel.from_torch(topology))   # before building the model
    model = build_model(config, parallel, ...)
    prepare_flashinfer_fusion(model)          # creates the workspaces and binds these too

Why: a process-group all-reduce is not always capturable in a CUDA graph (ranks that share a
GPU run gloo, which copies through the host), and NCCL's small-message latency is what engines
replace with a custom all-reduce. With every sum on the workspace a whole decode step captures.

Only `all_reduce` changes; every other operation goes to the wrapped `Collectives`. The kernel
takes a tensor when its group's workspace is bound for its dtype and it fits (rows of a width
the kernel takes, at most the workspace's elements); anything else goes to the wrapped group.
Both tests read only the shape and dtype, which every rank of a group shares, so ranks never
disagree on which path runs.

Inside a compiled region each operation is one `layer_boundary::<operation>` op (the core's
`graph_collectives`) whose run-time implementation is this object's method: the kernel or the
wrapped group is chosen when it runs, as eagerly, and no launch is traced.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from layer_boundary.plugin import graph_collectives

from .eligibility import kernel_width_reason

__all__ = ["FlashInferCollectives", "flashinfer_collectives", "wrapped_flashinfer_collectives"]


class _BoundAllReduce:
    """The kernel of one (group, dtype) workspace: `launch(x2d) -> summed`."""

    __slots__ = ("launch", "capacity", "hidden", "max_tokens", "cuda")

    def __init__(self, launch: Callable, capacity: int, hidden: int, max_tokens: int, cuda: bool):
        self.launch, self.capacity, self.hidden, self.max_tokens, self.cuda = launch, capacity, hidden, max_tokens, cuda


@graph_collectives
class FlashInferCollectives:
    """A `Collectives` whose `all_reduce` runs FlashInfer's all-reduce kernel once prepared."""

    #: its kernel is opaque to a tracer (and the wrapped group's own nature does not matter)
    graph_native = False

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.size = inner.size
        self.rank = inner.rank
        self.ranks = tuple(inner.ranks)
        self._bound: dict = {}  #: dtype -> _BoundAllReduce
        self.kernel_calls = 0  #: how many all-reduces ran on the workspace (for reports and checks)

    # binding (prepare_flashinfer_fusion) -------------------------------------------------------
    def bind(self, dtype: torch.dtype, launch: Callable, *, max_tokens: int, hidden: int, cuda: bool = True) -> None:
        self._bound[dtype] = _BoundAllReduce(launch, max_tokens * hidden, hidden, max_tokens, cuda)

    def unbind(self) -> None:
        """Called by the workspace's release or rebuild: back to the wrapped group."""
        self._bound = {}

    @property
    def bound_dtypes(self) -> tuple:
        return tuple(self._bound)

    def _view(self, x: torch.Tensor, bound: _BoundAllReduce) -> Optional[torch.Tensor]:
        """`x` as [rows, width] for the kernel, or None where the kernel does not take it."""
        n = x.numel()
        if not 0 < n <= bound.capacity or x.is_cuda is not bound.cuda:
            return None
        width = x.shape[-1] if x.dim() >= 1 else 1
        if x.dim() >= 2 and n // width <= bound.max_tokens and kernel_width_reason(width, x.dtype) is None:
            return x.reshape(n // width, width)
        if n % bound.hidden == 0:
            return x.reshape(n // bound.hidden, bound.hidden)
        return None

    # the Collectives protocol ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        bound = self._bound.get(x.dtype)
        if bound is not None and self.size > 1:
            if not x.is_contiguous():
                x = x.contiguous()
            rows = self._view(x, bound)
            if rows is not None:
                self.kernel_calls += 1
                return bound.launch(rows).view(x.shape)
        return self.inner.all_reduce(x)

    def reduce_scatter(self, x):
        return self.inner.reduce_scatter(x)

    def reduce_scatterv(self, x, sizes):
        return self.inner.reduce_scatterv(x, sizes)

    def all_gather(self, x):
        return self.inner.all_gather(x)

    def all_gatherv(self, x, sizes):
        return self.inner.all_gatherv(x, sizes)

    def agree(self, ok: bool) -> bool:
        return self.inner.agree(ok)

    def __getattr__(self, item):
        # `group`, `device` and the like of the wrapped Collectives (a torch process group)
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)

    def __repr__(self) -> str:
        state = f"bound for {[str(d) for d in self._bound]}" if self._bound else "not prepared"
        return f"FlashInferCollectives({self.inner!r}, {state})"


def flashinfer_collectives(parallel):
    """`parallel` with every group of more than one rank wrapped in a `FlashInferCollectives`
    (build the model on the result; `prepare_flashinfer_fusion(model)` binds them)."""
    return parallel.with_groups(lambda g: FlashInferCollectives(g) if g.size > 1 and not _find(g) else g)


def _find(group) -> Optional[FlashInferCollectives]:
    seen = 0
    while group is not None and seen < 16:  # through wrappers such as CountingCollectives
        if isinstance(group, FlashInferCollectives):
            return group
        group = vars(group).get("inner") if hasattr(group, "__dict__") else None
        seen += 1
    return None


def wrapped_flashinfer_collectives(groups) -> list:
    """The distinct `FlashInferCollectives` inside `groups` (Collectives, maybe wrapped)."""
    out: list = []
    for group in groups:
        found = _find(group)
        if found is not None and all(found is not o for o in out):
            out.append(found)
    return out
