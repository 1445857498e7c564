"""Where the plugin's multi-rank GPU checks run: the one place that asks the core for a world.

`layer_boundary.launch.ProcessWorld(n, device="cuda")` places the ranks (`placement.py`): NCCL
with one GPU a rank, or round-robin on fewer GPUs with a gloo process group (NCCL refuses two
ranks on one device). The one-shot kernels then exchange through CUDA IPC within the device and
two processes' kernels time-slice: that world checks correctness only.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["rank_device", "use_rank_device", "world_note", "gpu_world"]


def _placement(ranks: Optional[int] = None):
    from layer_boundary.placement import current_placement, place_ranks

    placement = current_placement()
    if placement is not None and placement.on_gpu:
        return placement
    return place_ranks(ranks or 1, "cuda")


def rank_device(rank: int) -> int:
    """The GPU index of (local) rank `rank` in this world's placement."""
    return _placement(rank + 1).device_of(rank)


def use_rank_device(rank) -> torch.device:
    """In a rank's process: its GPU, made current (the launcher has normally done so already).
    `rank`: an int or a Parallel."""
    rank = int(getattr(rank, "rank", rank))
    device = torch.device("cuda", rank_device(rank))
    torch.cuda.set_device(device)
    return device


def world_note(ranks: int) -> str:
    from layer_boundary.placement import place_ranks

    return place_ranks(ranks, "cuda").describe()


def gpu_world(ranks: int, *, timeout: float = 180.0, collective_timeout: float = 120.0, env: Optional[dict] = None):
    """A `ProcessWorld` of `ranks` GPU ranks (placed by the core; NVLink multicast off)."""
    from layer_boundary.launch import ProcessWorld
    from layer_boundary.placement import NO_MULTICAST_ENV

    return ProcessWorld(
        ranks, device="cuda", timeout=timeout, collective_timeout=collective_timeout, env={**NO_MULTICAST_ENV, **(env or {})}
    )
