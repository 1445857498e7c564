"""Collectives: the only way the boundary talks to other ranks.

A `Collectives` object is one process group seen from one rank. The boundary never calls
`torch.distributed` directly, so an engine can hand in its own implementation (a custom
all-reduce, a group it already built) and tests can run ranks as threads.

Every operation consumes its input: an implementation may reduce in place and return the
same storage. Row counts passed to the variable-size operations (`sizes`) must be identical on
every rank of the group; the boundary derives them from batch facts that all ranks share.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Protocol, Sequence, runtime_checkable

import torch

from ._graph import graph_collectives

__all__ = [
    "Collectives",
    "CollectivesBase",
    "SingleRankCollectives",
    "TorchCollectives",
    "CountingCollectives",
    "CollectiveCounter",
    "split_sizes",
]


def split_sizes(rows: int, parts: int) -> tuple[int, ...]:
    """Rows per part when `rows` are split as evenly as possible; earlier parts take the extra."""
    if parts == 1:  # the common case (attn_tp == 1), paid by every Forward
        return (rows,)
    base, extra = rows // parts, rows % parts  # not divmod: Dynamo rejects it on a symbolic row count
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


@runtime_checkable
class Collectives(Protocol):
    """One process group seen from one rank."""

    name: str
    size: int
    rank: int
    ranks: tuple[int, ...]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatterv(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gatherv(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor: ...

    def agree(self, ok: bool) -> bool:
        """True only when `ok` holds on every rank (CollectivesBase implements it)."""


@graph_collectives
class CollectivesBase:
    """Shape checks and the variable-size operations written over the equal-size ones.

    Subclasses implement `_all_reduce`, `_reduce_scatter` and `_all_gather` (equal shares,
    dim 0). An empty tensor is returned at once: every rank of a group passes the same shape to
    these operations, so the skip is the same on all of them and never leaves a rank waiting.

    Inside a compiled region each operation over more than one rank is one
    `layer_boundary::<operation>` graph node (`graph_collectives`), unless the subclass traces
    natively (`graph_native`: `TorchCollectives` over a group that needs no host staging uses
    functional collectives).
    """

    #: the operations are traceable as written (no custom op around them)
    graph_native = False

    name: str
    size: int
    rank: int
    ranks: tuple[int, ...]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1 or x.numel() == 0:
            return x
        return self._all_reduce(x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter over {self.name} needs rows divisible by {self.size}, got {x.shape[0]}; "
                "use reduce_scatterv for uneven shares"
            )
        if self.size == 1:
            return x
        if x.numel() == 0:
            return x[: x.shape[0] // self.size]
        return self._reduce_scatter(x.contiguous())

    def reduce_scatterv(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        sizes = tuple(sizes)
        self._check_sizes(sizes, x.shape[0], "reduce_scatterv")
        if self.size == 1:
            return x
        width = max(sizes)
        if width == 0:
            return x[:0]
        if all(s == width for s in sizes):
            return self._reduce_scatter(x.contiguous())
        padded = x.new_zeros((width * self.size,) + tuple(x.shape[1:]))
        start = 0
        for i, s in enumerate(sizes):
            padded[i * width : i * width + s] = x[start : start + s]
            start += s
        return self._reduce_scatter(padded)[: sizes[self.rank]]

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if x.numel() == 0:
            return x.new_empty((x.shape[0] * self.size,) + tuple(x.shape[1:]))
        return self._all_gather(x.contiguous())

    def all_gatherv(self, x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        sizes = tuple(sizes)
        if len(sizes) != self.size:
            raise ValueError(f"all_gatherv over {self.name} needs {self.size} sizes, got {len(sizes)}")
        if x.shape[0] != sizes[self.rank]:
            raise ValueError(
                f"all_gatherv over {self.name}: rank {self.rank} holds {x.shape[0]} rows but sizes say {sizes[self.rank]}"
            )
        if self.size == 1:
            return x
        width = max(sizes)
        if width == 0:
            return x.new_empty((0,) + tuple(x.shape[1:]))
        if all(s == width for s in sizes):
            return self._all_gather(x.contiguous())
        padded = x.new_zeros((width,) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        gathered = self._all_gather(padded)
        return torch.cat([gathered[i * width : i * width + s] for i, s in enumerate(sizes)])

    #: where small control tensors (agreement votes) live for this group
    device = "cpu"

    def agree(self, ok: bool) -> bool:
        """True only if `ok` is true on every rank of the group (one tiny all-reduce).

        Use it for any decision that selects a collective path, so that one rank's failure
        (a workspace that did not allocate, a kernel that did not compile) turns the path off on
        all ranks instead of leaving the others waiting in a collective it will never join.
        """
        if self.size == 1:
            return bool(ok)
        vote = torch.tensor([0.0 if ok else 1.0], dtype=torch.float32, device=self.device)
        return float(self._all_reduce(vote).item()) == 0.0

    def _check_sizes(self, sizes: tuple[int, ...], rows: int, op: str) -> None:
        if len(sizes) != self.size:
            raise ValueError(f"{op} over {self.name} needs {self.size} sizes, got {len(sizes)}")
        if sum(sizes) != rows:
            raise ValueError(f"{op} over {self.name}: sizes {sizes} do not add up to the {rows} input rows")

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, rank {self.rank} of {self.size})"


class SingleRankCollectives(CollectivesBase):
    """A group of one: every operation is the identity. Used for size-one axes."""

    def __init__(self, name: str, global_rank: int = 0):
        self.name = name
        self.size = 1
        self.rank = 0
        self.ranks = (global_rank,)


class TorchCollectives(CollectivesBase):
    """A `torch.distributed` process group (gloo on CPU, NCCL on GPU).

    Over gloo, CUDA tensors are staged through host memory (ranks that share a GPU run gloo:
    see `placement.py`); the result lands back on the input's device.
    """

    def __init__(self, name: str, group, ranks: Sequence[int]):
        import torch.distributed as dist

        self._dist = dist
        # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor (a FutureWarning on
        # every call) for the *_single names, which older torch (>= 2.4 supported) lacks
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.name = name
        self.group = group
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        backend = dist.get_backend(group)
        self.host_staged = backend == "gloo"
        if backend == "nccl":
            self.device = f"cuda:{torch.cuda.current_device()}"
        #: inside a compiled region: functional collectives (native graph nodes the compiler can
        #: schedule) wherever no tensor is staged through the host; else the layer_boundary ops
        self.graph_native = functional_collectives_ok(self)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():
            return _funcol().all_reduce(x, "sum", self.group)
        if not x.is_contiguous():
            x = x.contiguous()
        if self.host_staged and x.is_cuda:
            host = x.cpu()
            self._dist.all_reduce(host, group=self.group)
            return x.copy_(host)
        self._dist.all_reduce(x, group=self.group)
        return x

    def _reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():
            return _funcol().reduce_scatter_tensor(x, "sum", 0, self.group)
        if self.host_staged and x.is_cuda:
            return self._reduce_scatter(x.cpu()).to(x.device)
        out = x.new_empty((x.shape[0] // self.size,) + tuple(x.shape[1:]))
        self._scatter(out, x, group=self.group)
        return out

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_dynamo_compiling():
            return _funcol().all_gather_tensor(x, 0, self.group)
        if self.host_staged and x.is_cuda:
            return self._all_gather(x.cpu()).to(x.device)
        out = x.new_empty((x.shape[0] * self.size,) + tuple(x.shape[1:]))
        self._gather(out, x, group=self.group)
        return out


def _funcol():
    from torch.distributed import _functional_collectives

    return _functional_collectives


def functional_collectives_ok(group: "TorchCollectives") -> bool:
    """Whether a compiled region can trace `group`'s operations as functional collectives: a
    group that stages CUDA tensors through the host (gloo on a GPU, ranks sharing one) cannot, so
    its operations become layer_boundary ops that run the staging eagerly.
    `LAYER_BOUNDARY_FUNCTIONAL_COLLECTIVES=0` turns functional collectives off everywhere."""
    from ._env import env_flag

    if not env_flag("LAYER_BOUNDARY_FUNCTIONAL_COLLECTIVES", True):
        return False
    return not (group.host_staged and torch.cuda.is_available())


class CollectiveCounter:
    """Counts collectives by (operation, group name) and the time spent in them."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.seconds = 0.0

    def snapshot(self) -> dict[str, int]:
        return {f"{op}@{group}": n for (op, group), n in sorted(self.calls.items())}

    def reset(self) -> None:
        self.calls.clear()
        self.seconds = 0.0


@graph_collectives
class CountingCollectives:
    """Wraps a Collectives and counts what it issues (for `layer-boundary run` and tests).

    Only operations that reach other ranks are counted: a size-one group or an empty tensor
    issues nothing. Inside a compiled region each operation is one graph node that counts when
    it runs, never when it is traced.
    """

    def __init__(self, inner: Collectives, counter: CollectiveCounter):
        self.inner = inner
        self.counter = counter
        self.name = inner.name
        self.size = inner.size
        self.rank = inner.rank
        self.ranks = inner.ranks

    def _run(self, op: str, issues: bool, fn, *args):
        if not issues:
            return fn(*args)
        self.counter.calls[(op, self.name)] += 1
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.counter.seconds += time.perf_counter() - start

    def all_reduce(self, x):
        return self._run("all_reduce", self.size > 1 and x.numel() > 0, self.inner.all_reduce, x)

    def reduce_scatter(self, x):
        return self._run("reduce_scatter", self.size > 1 and x.numel() > 0, self.inner.reduce_scatter, x)

    def reduce_scatterv(self, x, sizes):
        return self._run("reduce_scatterv", self.size > 1 and max(sizes, default=0) > 0, self.inner.reduce_scatterv, x, sizes)

    def all_gather(self, x):
        return self._run("all_gather", self.size > 1 and x.numel() > 0, self.inner.all_gather, x)

    def all_gatherv(self, x, sizes):
        return self._run("all_gatherv", self.size > 1 and max(sizes, default=0) > 0, self.inner.all_gatherv, x, sizes)

    def agree(self, ok):
        return self._run("agree", self.size > 1, self.inner.agree, ok)

    def __getattr__(self, item):
        return getattr(self.inner, item)
