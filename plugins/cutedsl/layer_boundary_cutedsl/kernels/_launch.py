"""Launch plumbing shared by the torch-facing kernels: bound executors, streams, checks.

Everything a call needs after the first one is found by one dict lookup keyed by the variant
tuple and the device; a call then converts a few integers and launches on the current torch
stream (so it is CUDA-graph capturable once the first, eager call has loaded the kernel).
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import torch

from .tiling import default_grid

__all__ = ["executor_for", "launch", "check_rows", "as_rows", "DEBUG"]

#: host-side checks that need a device sync (indices in range): LAYER_BOUNDARY_DEBUG=1
DEBUG = os.environ.get("LAYER_BOUNDARY_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")

_lock = threading.Lock()
_executors: dict = {}  # (key, device index) -> (executor, threads, num_sms)
_streams: dict = {}  # stream handle -> cuda.CUstream


def executor_for(key: tuple, device: torch.device, make_variant: Callable):
    """(executor, threads, num_sms) for variant `key` on `device`; compiled and bound once."""
    entry = _executors.get((key, device.index))
    if entry is None:
        with _lock:
            entry = _executors.get((key, device.index))
            if entry is None:
                from .compiler import get_compiled, target_arch

                variant = make_variant()
                with torch.cuda.device(device):
                    compiled = get_compiled(variant, target_arch(device))
                    executor = compiled.to(device.index)
                    sms = torch.cuda.get_device_properties(device).multi_processor_count
                entry = (executor, variant.tiling().threads, sms)
                _executors[(key, device.index)] = entry
    return entry


def _stream(device: torch.device):
    handle = torch.cuda.current_stream(device).cuda_stream
    s = _streams.get(handle)
    if s is None:
        import cuda.bindings.driver as cuda

        s = _streams[handle] = cuda.CUstream(handle)
    return s


def launch(entry, rows: int, addresses: list, eps: float, device: torch.device) -> None:
    executor, threads, sms = entry
    grid = default_grid(rows, threads, sms)
    if grid == 0:
        return
    args = (*addresses, rows, eps, grid, _stream(device))
    if torch.cuda.current_device() == device.index:
        executor(*args)
    else:
        with torch.cuda.device(device):
            executor(*args)


def as_rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """`t` viewed as [rows, hidden] (a view, never a copy)."""
    return t.view(-1, hidden)


def check_rows(name: str, t: torch.Tensor, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise unless `t` is [rows, hidden] of `dtype` on `device`, rows back to back, 16-byte aligned."""
    if t.dtype != dtype:
        raise TypeError(f"{name} is {t.dtype}, expected {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != hidden:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({rows}, {hidden})")
    if rows > 1 and t.stride(0) != hidden or hidden > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be row-major with rows back to back (stride ({hidden}, 1)), got {t.stride()}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (data_ptr % 16 = {t.data_ptr() % 16})")
