"""Running a function on every GPU rank of one host: under torchrun, or spawned here.

For `layer-boundary bench fusion` (`bench.py`). Ranks are placed on the visible GPUs by
`layer_boundary.place_ranks`: one GPU a rank over NCCL, or, when ranks outnumber the GPUs, several
ranks on one GPU over gloo (the trtllm workspaces map peer memory inside the device; correctness
only, timings are not representative). The flashinfer workspaces are released before the process
group is destroyed (a workspace left alive can hang the exit).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Callable, Optional

from layer_boundary import RankPlacement, current_placement, place_ranks

__all__ = ["run_ranks", "NO_MULTICAST_ENV", "world_placement"]

#: the trtllm workspaces need no NVLink multicast; keep NCCL and torch from using it either
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_PLACEMENT: Optional[RankPlacement] = None


def world_placement() -> Optional[RankPlacement]:
    """The placement of the world this rank runs in (set by `run_ranks`)."""
    return _PLACEMENT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, local_rank: int, init_method: str, placement: RankPlacement, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    global _PLACEMENT
    _PLACEMENT = placement
    torch.cuda.set_device(placement.device_of(local_rank))
    # a long collective timeout: ranks wait in an agreement while another JIT-builds FlashInfer (minutes)
    dist.init_process_group(placement.backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    from .service import default_manager

    try:
        fn(rank, world, *args)
    except BaseException:
        # peers may be stuck in another collective: release this rank's part without a barrier
        default_manager().shutdown(barrier=False)
        raise
    else:
        default_manager().shutdown(barrier=True)  # in lock-step, before the process group goes
    finally:
        dist.destroy_process_group()


def _spawned(index: int, world: int, init_method: str, placement: RankPlacement, fn: Callable, args: tuple) -> None:
    _rank_main(index, world, index, init_method, placement, fn, args)


def run_ranks(fn: Callable, args: tuple, world: int) -> None:
    """`fn(rank, world, *args)` on `world` GPU ranks (`fn` must be a module-level function)."""
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        placement = current_placement("cuda") or place_ranks(int(os.environ["WORLD_SIZE"]), "cuda")
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)),
                   "env://", placement, fn, args)
        return
    import torch.multiprocessing as mp

    try:
        placement = place_ranks(world, "cuda")
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    if placement.note:
        print(placement.note, file=sys.stderr, flush=True)
    mp.spawn(_spawned, args=(world, f"tcp://127.0.0.1:{_free_port()}", placement, fn, args), nprocs=world, join=True)
