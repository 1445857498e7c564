"""Where the ranks of one host run, and how they talk: one GPU a rank, or several ranks sharing GPUs.

With as many GPUs as ranks nothing is special: NCCL, rank `r` on GPU `r`. With fewer GPUs than
ranks (the one-GPU machine, or 4 ranks on 2 GPUs) the ranks are placed round-robin and share
devices; NCCL refuses two ranks on one device, so the process group is gloo and the
`Collectives` stage CUDA tensors through the host. Fusion kernels that map peer memory (CUDA IPC)
work there too, since IPC inside one device is allowed: that world checks correctness of every
multi-rank path, but two processes' kernels time-slice on a shared GPU, so its timings say
nothing about performance (`SharedDevice.note`).

The launcher computes a placement once, in the parent, and hands each rank its device; a rank
reads its world's placement back with `current_placement()` (from the environment the launcher
or torchrun set), so benchmarks can label their numbers.
"""

from __future__ import annotations

import os
from typing import Optional

import attrs

__all__ = [
    "RankPlacement",
    "place_ranks",
    "current_placement",
    "PLACEMENT_ENV",
    "NO_MULTICAST_ENV",
]

#: set by the launcher in every rank: "<ranks>x<gpus>" (gpus 0: CPU)
PLACEMENT_ENV = "LAYER_BOUNDARY_PLACEMENT"

#: NVLink multicast stays off everywhere the ranks run (no kernel here needs it; it can take a
#: shared host's GPUs down): NCCL, torch symmetric memory and NVSHMEM
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@attrs.frozen
class RankPlacement:
    """`ranks` processes of one host on `gpus` visible GPUs (0: CPU ranks)."""

    ranks: int
    gpus: int

    def __attrs_post_init__(self):
        if self.ranks < 1 or self.gpus < 0:
            raise ValueError(f"a placement needs at least one rank and no negative GPU count, got {self.ranks} ranks on {self.gpus} GPUs")

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0

    @property
    def shared(self) -> bool:
        """Some GPU holds more than one rank (correctness only)."""
        return 0 < self.gpus < self.ranks

    @property
    def backend(self) -> str:
        """NCCL needs one GPU a rank; everything else runs gloo."""
        return "nccl" if self.on_gpu and not self.shared else "gloo"

    @property
    def devices_used(self) -> int:
        return min(self.ranks, self.gpus)

    def device_of(self, local_rank: int) -> Optional[int]:
        """The GPU index of a rank (round-robin), None on CPU."""
        return local_rank % self.gpus if self.on_gpu else None

    @property
    def note(self) -> Optional[str]:
        """The one line a shared world prints; None when every rank has its own device."""
        if not self.shared:
            return None
        gpus = self.devices_used
        return f"{self.ranks} ranks on {gpus} GPU{'s' if gpus != 1 else ''}: correctness only; timings are not representative"

    def describe(self) -> str:
        if not self.on_gpu:
            return f"{self.ranks} rank(s) on the CPU (gloo)"
        return self.note or f"{self.ranks} rank(s), one GPU each (nccl)"

    def encode(self) -> str:
        return f"{self.ranks}x{self.gpus}"

    @classmethod
    def decode(cls, text: str) -> "RankPlacement":
        ranks, _, gpus = text.partition("x")
        return cls(int(ranks), int(gpus))


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def place_ranks(ranks: int, device: str = "cpu", *, gpus: Optional[int] = None) -> RankPlacement:
    """The placement of `ranks` local ranks for `device` ("cpu" or "cuda"); `gpus` overrides
    the count of visible GPUs (tests, or to leave some GPUs out)."""
    if device == "cpu":
        return RankPlacement(ranks, 0)
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    count = visible_gpus() if gpus is None else int(gpus)
    if count < 1:
        raise RuntimeError("no CUDA device is visible; run on a GPU machine or use the CPU")
    return RankPlacement(ranks, count)


def current_placement(device: Optional[str] = None) -> Optional[RankPlacement]:
    """The placement of the world this process is a rank of: what the launcher recorded, or
    under torchrun, this node's ranks (LOCAL_WORLD_SIZE) on its visible GPUs. None when it
    cannot tell (a plain single process)."""
    recorded = os.environ.get(PLACEMENT_ENV)
    if recorded:
        return RankPlacement.decode(recorded)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        if device is None:
            device = "cuda" if visible_gpus() else "cpu"
        return place_ranks(int(local), device)
    return None
