"""Ranks as spawned processes over `torch.distributed`, reused across calls: the launcher of
`layer-boundary run`, the gloo test world and the GPU worlds of the checks.

`ProcessWorld(n).run(fn, topology, *args)` calls `fn(parallel, *args)` on every rank and returns
the per-rank results. `fn` must be importable by name (a module-level function). Each call has
a timeout: a rank that hangs or dies makes the call fail with a message naming the ranks, and
the world is torn down (the next call starts a fresh one).

`ProcessWorld(n, device="cuda")` places the ranks on the visible GPUs (`placement.py`): NCCL
with one GPU a rank, or gloo when ranks share a GPU (correctness only; `world.placement.note`).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, Optional

from ._parallel import Parallel, Topology
from .placement import NO_MULTICAST_ENV, PLACEMENT_ENV, RankPlacement, place_ranks

__all__ = ["ProcessWorld", "RankError", "RankTimeout", "worker_parallel"]


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback. `failures` holds, per failed rank,
    `(rank, chain)`: the exceptions of the error's chain (the raised one first, then its causes),
    each `(class names of its type's MRO, message)`, so a caller can tell one kind of failure
    (a plugin's) from another without parsing tracebacks."""

    def __init__(self, message: str, failures: tuple = ()):
        super().__init__(message)
        self.failures = tuple(failures)


def _chain(exc: BaseException) -> list:
    """(MRO class names, message) of `exc` and each exception it was raised from or during."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append((tuple(c.__name__ for c in type(exc).__mro__), str(exc)))
        exc = exc.__cause__ or exc.__context__
    return out


class RankTimeout(TimeoutError):
    """Ranks did not answer in time (a hang, or a dead rank)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PARALLEL_CACHE: dict = {}


def worker_parallel(topology: Topology) -> Parallel:
    """In a worker: the Parallel of `topology` on the initialised world (groups made once)."""
    key = topology
    if key not in _PARALLEL_CACHE:
        _PARALLEL_CACHE[key] = Parallel.from_torch(topology)
    return _PARALLEL_CACHE[key]


def _worker(
    rank: int, size: int, port: int, conn, path: list, env: dict, collective_timeout: float, backend: str, device: Optional[int]
) -> None:
    sys.path[:] = path
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    if device is not None:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, topology, args, kwargs = message
        try:
            parallel = worker_parallel(topology) if topology is not None else rank
            conn.send(("ok", fn(parallel, *args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", traceback.format_exc(), _chain(exc)))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _placement_and_backend(size: int, device: Optional[str], backend: Optional[str], gpus: Optional[int]) -> tuple:
    if device is None:
        device = "cuda" if backend == "nccl" else "cpu"
    placement = place_ranks(size, device, gpus=gpus)
    if backend is None:
        backend = placement.backend
    if backend == "nccl" and placement.shared:
        raise ValueError(
            f"NCCL needs one GPU a rank, and {placement.ranks} ranks share {placement.devices_used} GPU(s); "
            "leave the backend unset to share the GPUs over gloo (correctness only)"
        )
    if backend == "nccl" and not placement.on_gpu:
        raise ValueError("the nccl backend needs device='cuda'")
    return placement, backend


class ProcessWorld:
    """`size` rank processes on this host (see the module docstring).

    `device`: "cpu" (gloo, one thread a rank) or "cuda" (ranks placed round-robin on the visible
    GPUs, or on the first `gpus` of them). `backend`: left unset, the placement chooses (NCCL with
    one GPU a rank, else gloo).
    """

    def __init__(
        self,
        size: int,
        *,
        backend: Optional[str] = None,
        device: Optional[str] = None,
        gpus: Optional[int] = None,
        timeout: float = 120.0,
        collective_timeout: float = 60.0,
        env: Optional[dict] = None,
    ):
        self.size = size
        self.placement: RankPlacement
        self.placement, self.backend = _placement_and_backend(size, device, backend, gpus)
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self.env = dict(env or {})
        self._procs: list = []
        self._conns: list = []

    # lifecycle --------------------------------------------------------------------------------
    @property
    def note(self) -> Optional[str]:
        """One line when ranks share a GPU ("correctness only"), else None."""
        return self.placement.note

    def start(self) -> "ProcessWorld":
        if self._procs:
            return self
        ctx = mp.get_context("spawn")
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k.startswith(("LAYER_BOUNDARY_", "HF_", "TRANSFORMERS_", "NCCL_", "TORCH_", "NVSHMEM_", "FLASHINFER_", "CUDA_"))}
        if self.placement.on_gpu:
            env = {**NO_MULTICAST_ENV, **env}
        env[PLACEMENT_ENV] = self.placement.encode()
        env.update(self.env)
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(rank, self.size, port, child, list(sys.path), env, self.collective_timeout, self.backend,
                      self.placement.device_of(rank)),
                daemon=True,
                name=f"{self.backend}-rank{rank}",
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._collect("start")
        return self

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._procs, self._conns = [], []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # calls --------------------------------------------------------------------------------------
    def run(self, fn: Callable, topology: Optional[Topology], *args, timeout: Optional[float] = None, **kwargs) -> list:
        if topology is not None and topology.world_size != self.size:
            raise ValueError(f"topology needs {topology.world_size} ranks; this world has {self.size}")
        self.start()
        for conn in self._conns:
            conn.send((fn, topology, args, kwargs))
        return self._collect(getattr(fn, "__name__", "call"), timeout)

    #: once a rank has failed, how long the others get to report before the world is torn down
    FAILURE_GRACE_S = 10.0

    def _collect(self, what: str, timeout: Optional[float] = None) -> list:
        """Answers of every rank. A rank's error is reported as soon as it arrives (the others,
        likely stuck in a collective with it, get a short grace), never as a timeout."""
        from multiprocessing.connection import wait

        deadline = timeout if timeout is not None else self.timeout
        results: list[Any] = [None] * self.size
        errors: list[str] = []
        failures: list[tuple] = []
        pending = dict(enumerate(self._conns))
        end = time.monotonic() + deadline
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                break
            for conn in wait(list(pending.values()), timeout=left):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, payload, *chain = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].join(5)  # reap it, so its exit code is known
                    errors.append(f"rank {rank}: died (exit code {self._procs[rank].exitcode})")
                    continue
                if status == "error":
                    errors.append(f"rank {rank}:\n{payload}")
                    failures.append((rank, chain[0] if chain else []))
                else:
                    results[rank] = payload
            if errors:
                end = min(end, time.monotonic() + self.FAILURE_GRACE_S)
        missing = sorted(pending)
        if errors:
            self.close()
            waiting = f" (ranks {missing} still waiting, likely in a collective with the failed rank)" if missing else ""
            raise RankError(f"{self.backend} world: {what} failed on {len(errors)} rank(s){waiting}\n" + "\n".join(errors),
                            failures)
        if missing:
            dead = [r for r in missing if not self._procs[r].is_alive()]
            self.close()
            raise RankTimeout(
                f"{self.backend} world: {what} got no answer from ranks {missing} within {deadline:.0f}s"
                + (f" (ranks {dead} died)" if dead else " (a hang: a rank waits in a collective the others never issued)")
            )
        return results
