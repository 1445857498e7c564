"""Running a function on every GPU rank of one host: under torchrun, or spawned here.

For the 2-GPU benchmark and check (`bench.py`, `gpu_check.py`). Each rank gets one GPU and an
NCCL world; the flashinfer workspaces are released before the process group is destroyed (a
workspace left alive can hang the exit).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Callable

__all__ = ["run_ranks", "NO_MULTICAST_ENV"]

#: the trtllm workspaces need no NVLink multicast; keep NCCL and torch from using it either
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, init_method: str, fn: Callable, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    # a long collective timeout: ranks wait in an agreement while another JIT-builds FlashInfer (minutes)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
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


def _spawned(index: int, world: int, init_method: str, fn: Callable, args: tuple) -> None:
    _rank_main(index, world, init_method, fn, args)


def run_ranks(fn: Callable, args: tuple, world: int) -> None:
    """`fn(rank, world, *args)` on `world` GPU ranks (`fn` must be a module-level function)."""
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", fn, args)
        return
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < world:
        raise SystemExit(f"this needs {world} CUDA GPUs on one host; {torch.cuda.device_count()} visible")
    mp.spawn(_spawned, args=(world, f"tcp://127.0.0.1:{_free_port()}", fn, args), nprocs=world, join=True)
