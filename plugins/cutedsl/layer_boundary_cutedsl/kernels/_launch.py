"""Launch plumbing shared by the torch-facing kernels: bound executors, streams, checks.

Everything a call needs after the first one is found by one dict lookup keyed by the variant
tuple and the device; a call then converts a few integers and launches on the current torch
stream (so it is CUDA-graph capturable once the first, eager call has loaded the kernel).
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from typing import Callable, NamedTuple

import torch

from .tiling import default_grid

__all__ = [
    "BoundKernel", "executor_for", "launch", "launch_args", "check_all", "check_rows", "rows_ok", "explain_rows", "address", "DEBUG",
    "FastCall", "pack_kinds", "routing_weights",
]

#: host-side checks that need a device sync (indices in range): LAYER_BOUNDARY_DEBUG=1
DEBUG = os.environ.get("LAYER_BOUNDARY_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")

#: cap on CTAs per launch (None: one per row); tests lower it to make CTAs loop over rows
MAX_CTAS = None

_lock = threading.Lock()
_executors: dict = {}  # (key, device index) -> BoundKernel


class BoundKernel(NamedTuple):
    """A compiled kernel bound to a device, with what its launch needs to size the grid."""

    launcher: Callable
    rows_per_cta: int
    sms: int
    #: False for a kernel without a grid-stride loop: every block of rows needs its own CTA
    loops: bool


_CTYPES = {"i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float, "stream": ctypes.c_void_p}


def pack_kinds(n_addresses: int) -> tuple:
    """The C types of a kernel entry's arguments: addresses, rows, eps, grid, stream."""
    return ("i64",) * n_addresses + ("i32", "f32", "i32", "stream")


class FastCall:
    """Calls a compiled entry with prebuilt ctypes buffers instead of the DSL's generic
    argument marshalling (which costs tens of microseconds of Python per call).

    The entry's packed-argument ABI is one pointer per argument to its value, then the
    executor's own trailing pointers (its CUDA error slot and kernel handles). `matches()`
    checks this layout against the DSL's generic marshalling once; `executor_for` falls back
    to the generic path when it does not match (another nvidia-cutlass-dsl version).
    """

    def __init__(self, executor, kinds: tuple):
        self._vals = [_CTYPES[k]() for k in kinds]
        extra = []
        if getattr(executor, "_has_cuda_result", False):
            extra.append(executor._cuda_result_addr)
        extra.extend(getattr(executor, "_kernel_ptrs", None) or ())
        self._packed = (ctypes.c_void_p * (len(kinds) + len(extra)))(*[ctypes.addressof(v) for v in self._vals], *extra)
        self._capi = executor.capi_func
        self._result = getattr(executor, "cuda_result", None)
        self._lock = threading.Lock()  # the buffers are shared: one launch at a time

    def set_args(self, args) -> None:
        for slot, a in zip(self._vals, args):
            slot.value = a

    def __call__(self, *args) -> None:
        with self._lock:
            for slot, a in zip(self._vals, args):
                slot.value = a
            self._capi(self._packed)
            error = self._result.value if self._result is not None else 0
        if error:
            raise RuntimeError(f"cutedsl kernel launch failed with CUDA error {error}")

    def matches(self, execution_args, probe: tuple) -> bool:
        """Whether the DSL marshals `probe` (with a CUstream last) to the same values."""
        import cuda.bindings.driver as cuda

        self.set_args(probe)
        generic, _keep = execution_args.generate_execution_args((*probe[:-1], cuda.CUstream(probe[-1])), {})
        if len(generic) != len(self._vals):
            return False
        for ptr, mine in zip(generic, self._vals):
            address = ptr.value if isinstance(ptr, ctypes.c_void_p) else int(ptr)
            if type(mine).from_address(address).value != mine.value:
                return False
        return True


def executor_for(key: tuple, device: torch.device, make_variant: Callable, n_addresses: int, *, kinds=None, probe=None):
    """The `BoundKernel` of variant `key` on `device`; compiled and bound once.

    `kinds`/`probe`: the entry's C argument types and a probe tuple of that layout (CUstream
    last), for entries whose scalars differ from `pack_kinds(n_addresses)`."""
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
                launcher = FastCall(executor, kinds or pack_kinds(n_addresses))
                if probe is None:
                    probe = (*range(0x1000, 0x1000 + 16 * n_addresses, 16), 7, 0.5, 3, 0x5150)
                if not launcher.matches(compiled.execution_args, probe):
                    warnings.warn("cutedsl: unexpected argument ABI; using the slower generic launch path")
                    launcher = _GenericCall(executor)
                # a kernel without a grid-stride loop needs every block's CTA: never capped
                entry = BoundKernel(launcher, variant.tiling().rows_per_cta, sms, not getattr(variant, "no_loop", False))
                _executors[(key, device.index)] = entry
    return entry


class _GenericCall:
    def __init__(self, executor):
        self._executor = executor

    def __call__(self, *args):
        import cuda.bindings.driver as cuda

        self._executor(*args[:-1], cuda.CUstream(args[-1]))


def _raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


try:  # the cheap getter torch's compiled code uses; same value as current_stream().cuda_stream
    from torch._C import _cuda_getCurrentRawStream as _raw_stream  # noqa: F811
except ImportError:  # pragma: no cover
    pass


def launch(entry, rows: int, addresses: list, eps: float, device: torch.device) -> None:
    """A row kernel's launch: its addresses, then `rows` and eps (`pack_kinds`)."""
    launch_args(entry, rows, (*addresses, rows, eps), device)


def launch_args(entry, rows: int, args: tuple, device: torch.device) -> None:
    """Launch `entry` over `rows` work rows (its grid from them) with `args`, then the grid and
    the current stream of `device`."""
    launcher, rows_per_cta, sms, loops = entry
    grid = default_grid(rows, rows_per_cta, sms)
    if grid == 0:
        return
    if MAX_CTAS is not None and loops:
        grid = min(grid, MAX_CTAS)
    stream = _raw_stream(device.index)
    if torch.cuda.current_device() == device.index:
        launcher(*args, grid, stream)
    else:
        with torch.cuda.device(device):
            launcher(*args, grid, stream)


def rows_ok(t: torch.Tensor, shape, dtype: torch.dtype, device: torch.device) -> bool:
    """The cheap per-call test (a contiguous tensor of that shape has its rows back to back)."""
    return t.dtype == dtype and t.shape == shape and t.device == device and t.is_contiguous() and t.data_ptr() % 16 == 0


def explain_rows(name: str, t: torch.Tensor, shape, dtype: torch.dtype, device: torch.device) -> None:
    """Raise the reason `rows_ok` failed for `t`."""
    if t.dtype != dtype:
        raise TypeError(f"{name} is {t.dtype}, expected {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be row-major with rows back to back (contiguous), got strides {t.stride()}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary (data_ptr % 16 = {t.data_ptr() % 16})")


def check_all(named: tuple) -> None:
    """`named`: (name, tensor, shape, dtype, device) tuples; raise on the first that fails."""
    for name, t, shape, dtype, device in named:
        if not rows_ok(t, shape, dtype, device):
            explain_rows(name, t, shape, dtype, device)


def check_rows(dtype: torch.dtype, device: torch.device, shape, **named) -> None:
    """`check_all` of the named tensors in order (None: an absent optional one): rows of `shape`,
    except `gamma`, one row of the width."""
    check_all(tuple((name, t, (shape[-1],) if name == "gamma" else shape, dtype, device) for name, t in named.items() if t is not None))


def address(t) -> int:
    """The device address a kernel argument passes for tensor `t`; 0 for an absent one (None)."""
    return 0 if t is None else t.data_ptr()


def routing_weights(weights: torch.Tensor) -> torch.Tensor:
    """MoE routing weights [T, top_k] as the kernels read them: fp32, contiguous (a copy of a small
    tensor when they are not)."""
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()  # small [T, k]: a copy is cheap
    return weights
