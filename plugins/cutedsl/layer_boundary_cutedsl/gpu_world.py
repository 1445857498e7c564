"""Where GPU ranks run: the one place that decides each rank's device and the process group's
backend for the plugin's multi-rank GPU tests and smoke checks.

With at least as many GPUs as ranks: NCCL, one GPU a rank (rank r on GPU r). With fewer, ranks
share GPUs round-robin (rank r on GPU r % count) and the process group is gloo (NCCL refuses two
ranks on one device): the one-shot kernels then exchange through CUDA IPC within the device,
and two processes' kernels time-slice. That world checks correctness only; its timings are not
representative.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["NO_MULTICAST_ENV", "rank_device", "use_rank_device", "world_backend", "world_note", "gpu_world"]

#: no NVLink multicast anywhere (not allowed on the lent machines, and not needed)
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _gpus() -> int:
    return max(1, torch.cuda.device_count())


def rank_device(rank: int) -> int:
    """The GPU of global rank `rank` (round-robin over the visible GPUs)."""
    return rank % _gpus()


def use_rank_device(rank) -> torch.device:
    """In a rank's process: make its GPU current and return it. `rank`: an int or a Parallel."""
    rank = getattr(rank, "rank", rank)
    device = torch.device("cuda", rank_device(int(rank)))
    torch.cuda.set_device(device)
    return device


def world_backend(ranks: int) -> str:
    return "nccl" if torch.cuda.device_count() >= ranks else "gloo"


def world_note(ranks: int) -> str:
    gpus = torch.cuda.device_count()
    if gpus >= ranks:
        return f"{ranks} ranks on {ranks} GPUs (NCCL)"
    return f"{ranks} ranks on {gpus} GPU{'s' if gpus != 1 else ''}: correctness only; timings are not representative"


def gpu_world(ranks: int, *, timeout: float = 180.0, collective_timeout: float = 120.0, env: Optional[dict] = None):
    """A `layer_boundary.launch.ProcessWorld` of `ranks` GPU ranks; each rank function starts
    with `use_rank_device(parallel)`."""
    from layer_boundary.launch import ProcessWorld

    return ProcessWorld(
        ranks,
        backend=world_backend(ranks),
        timeout=timeout,
        collective_timeout=collective_timeout,
        env={**NO_MULTICAST_ENV, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
