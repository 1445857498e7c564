"""The threaded world: one thread per rank, collectives through barriers.

Collectives combine contributions in rank order, so every rank computes bit-identical results.
A rank that raises aborts every barrier, so the others fail at once with a clear error instead
of waiting; a rank that never joins makes the others time out.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from ..collectives import CollectivesBase
from .._parallel import Parallel, Topology

__all__ = ["ThreadWorld", "ThreadCollectives", "CollectiveAborted", "run_threaded"]


class CollectiveAborted(RuntimeError):
    """A collective could not complete: another rank failed, or a rank never joined."""


class _GroupState:
    def __init__(self, world: "ThreadWorld", name: str, ranks: tuple[int, ...]):
        self.world = world
        self.name = name
        self.ranks = ranks
        self.slots: list[Any] = [None] * len(ranks)
        self.ops: list[Any] = [None] * len(ranks)
        self.barrier = threading.Barrier(len(ranks))


class ThreadCollectives(CollectivesBase):
    def __init__(self, state: _GroupState, global_rank: int, name: str):
        self._state = state
        self.name = name
        self.ranks = state.ranks
        self.size = len(state.ranks)
        self.rank = state.ranks.index(global_rank)

    def _exchange(self, op: str, x: torch.Tensor, combine: Callable[[list], torch.Tensor]) -> torch.Tensor:
        state = self._state
        state.slots[self.rank] = x
        state.ops[self.rank] = (op, tuple(x.shape[1:]), x.dtype)
        self._wait(op)
        ops = list(state.ops)
        if len(set(ops)) != 1:
            # real backends hang or corrupt data here; every rank of the threaded world sees the
            # same table and fails with it (no second barrier, so no rank is left waiting)
            detail = ", ".join(f"rank {r}: {o[0]} {o[1]} {o[2]}" for r, o in zip(state.ranks, ops))
            raise CollectiveAborted(f"ranks of {self.name} issued different collectives: {detail}")
        try:
            return combine(list(state.slots))
        finally:
            self._wait(op)

    def _wait(self, op: str) -> None:
        world = self._state.world
        try:
            self._state.barrier.wait(timeout=world.timeout)
        except threading.BrokenBarrierError:
            if world.failed.is_set():
                raise CollectiveAborted(
                    f"{op} over {self.name} aborted on rank {self._state.ranks[self.rank]}: another rank failed"
                ) from None
            world.abort()
            raise CollectiveAborted(
                f"{op} over {self.name} timed out after {world.timeout:.0f}s on rank {self._state.ranks[self.rank]}: "
                "a rank of the group did not join (it issued a different collective, or hung)"
            ) from None

    def _all_reduce(self, x):
        def combine(parts):
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            return total

        return self._exchange("all_reduce", x, combine)

    def _reduce_scatter(self, x):
        n = x.shape[0] // self.size
        r = self.rank

        def combine(parts):
            total = parts[0][r * n : (r + 1) * n].clone()
            for p in parts[1:]:
                total += p[r * n : (r + 1) * n]
            return total

        return self._exchange("reduce_scatter", x, combine)

    def _all_gather(self, x):
        return self._exchange("all_gather", x, lambda parts: torch.cat(parts))


class ThreadWorld:
    """`size` ranks as threads. `run(fn, topology, *args)` calls `fn(parallel, *args)` on every
    rank and returns the per-rank results."""

    def __init__(self, size: int, *, timeout: float = 30.0):
        self.size = size
        self.timeout = timeout
        self.failed = threading.Event()
        self._lock = threading.Lock()
        self._groups: dict[tuple[int, ...], _GroupState] = {}

    def abort(self) -> None:
        self.failed.set()
        with self._lock:
            for state in self._groups.values():
                state.barrier.abort()

    def group(self, name: str, ranks: tuple[int, ...], rank: int) -> ThreadCollectives:
        # one state per rank set, as torch.distributed shares one process group among axes with
        # the same ranks: two axes' collectives then meet (and a mismatch between them is seen)
        key = ranks
        with self._lock:
            state = self._groups.get(key)
            if state is None:
                state = self._groups[key] = _GroupState(self, name, ranks)
        return ThreadCollectives(state, rank, name)

    def parallel(self, topology: Topology, rank: int) -> Parallel:
        return Parallel.create(topology, rank, lambda name, ranks: self.group(name, ranks, rank))

    def run(self, fn: Callable, topology: Optional[Topology], *args, **kwargs) -> list:
        if topology is not None and topology.world_size != self.size:
            raise ValueError(f"topology needs {topology.world_size} ranks; this world has {self.size}")
        self.failed.clear()
        self._groups.clear()
        results: list[Any] = [None] * self.size
        errors: list[Optional[BaseException]] = [None] * self.size

        def target(rank: int) -> None:
            try:
                parallel = self.parallel(topology, rank) if topology is not None else rank
                results[rank] = fn(parallel, *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors[rank] = exc
                if not _caused_by_abort(exc):
                    self.abort()

        threads = [threading.Thread(target=target, args=(r,), name=f"rank{r}", daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            self.abort()
            raise CollectiveAborted(f"ranks {alive} did not finish within {self.timeout * 4:.0f}s")
        root = [e for e in errors if e is not None and not _caused_by_abort(e)]
        if root:
            raise root[0]
        aborted = [e for e in errors if e is not None]
        if aborted:
            raise aborted[0]
        return results


def _caused_by_abort(exc: BaseException) -> bool:
    """A failure that is the consequence of a collective failing (possibly wrapped)."""
    while exc is not None:
        if isinstance(exc, CollectiveAborted):
            return True
        exc = exc.__cause__
    return False


def run_threaded(fn: Callable, topology: Topology, *args, timeout: float = 30.0, **kwargs) -> list:
    """Run `fn(parallel, *args)` on every rank of `topology` as threads."""
    return ThreadWorld(topology.world_size, timeout=timeout).run(fn, topology, *args, **kwargs)
