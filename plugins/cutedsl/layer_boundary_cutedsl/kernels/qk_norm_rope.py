"""`fused_qk_norm_rope`: per-head RMSNorm of queries and keys, then the rotary embedding, in one
CuTe DSL launch (torch-facing wrapper; the kernel is qk_norm_rope_dsl.py)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from . import _launch
from ._launch import executor_for, launch_args
from .tiling import SUPPORTED_DTYPES

__all__ = ["QKNormRopeVariant", "fused_qk_norm_rope", "prepare_qk_norm_rope", "check_geometry"]

HEAD_DIMS = (64, 128, 256)
#: the argument types of the kernel's entry: 8 addresses, tokens, two row strides, eps, grid, stream
KINDS = ("i64",) * 8 + ("i32", "i32", "i32", "f32", "i32", "stream")
PROBE = (*range(0x1000, 0x1000 + 16 * 8, 16), 7, 6144, 5120, 0.5, 3, 0x5150)


@dataclass(frozen=True)
class QKNormRopeVariant:
    """One compiled q/k norm + rope kernel: dtype, head geometry, PDL launch."""

    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    pdl: bool = True
    cta_threads: int = 128

    def tiling(self):
        return SimpleNamespace(rows_per_cta=self.cta_threads // (self.head_dim // 8), cta_threads=self.cta_threads)

    def kernel_object(self):
        from .qk_norm_rope_dsl import QKNormRopeKernel

        return QKNormRopeKernel(self)

    def example_args(self):
        import cuda.bindings.driver as cuda
        from cutlass import Float32, Int32, Int64

        return [Int64(0)] * 8 + [Int32(1), Int32(self.head_dim), Int32(self.head_dim), Float32(1e-6), Int32(1), cuda.CUstream(0)]

    @property
    def name(self) -> str:
        return f"qk_norm_rope_{str(self.dtype).split('.')[-1]}_d{self.head_dim}_h{self.heads}_kv{self.kv_heads}{'' if self.pdl else '_nopdl'}"


def check_geometry(dtype: torch.dtype, head_dim: int) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused_qk_norm_rope runs bf16/fp16, not {dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"fused_qk_norm_rope runs head_dim {HEAD_DIMS}, not {head_dim}")


def _entry(dtype, head_dim, heads, kv_heads, device, pdl=True):
    key = ("qk_norm_rope", dtype, head_dim, heads, kv_heads, pdl)
    return executor_for(key, device, lambda: QKNormRopeVariant(dtype, head_dim, heads, kv_heads, pdl), 8, kinds=KINDS, probe=PROBE)


def prepare_qk_norm_rope(dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int, device=None) -> None:
    """Compile and load the kernel now (before a CUDA-graph capture)."""
    check_geometry(dtype, head_dim)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _entry(dtype, head_dim, heads, kv_heads, device)


def _heads_ok(t: torch.Tensor, dtype, device, head_dim: int) -> bool:
    """[tokens, heads, head_dim] with heads back to back and 16-byte aligned rows (any row stride)."""
    return (
        t.dim() == 3 and t.dtype == dtype and t.device == device and t.shape[-1] == head_dim and t.stride(-1) == 1
        and (t.shape[1] == 1 or t.stride(1) == head_dim) and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
    )


def _explain(name: str, t: torch.Tensor, dtype, device, head_dim: int) -> None:
    if t.dim() != 3 or t.shape[-1] != head_dim:
        raise ValueError(f"{name} must be [tokens, heads, {head_dim}], got {tuple(t.shape)}")
    if t.dtype != dtype or t.device != device:
        raise TypeError(f"{name} is {t.dtype} on {t.device}, expected {dtype} on {device}")
    raise ValueError(
        f"{name} must have its heads back to back (strides (row, {head_dim}, 1), row a multiple of 8) and start on a "
        f"16-byte boundary; got strides {t.stride()}, data_ptr % 16 = {t.data_ptr() % 16}"
    )


_entries: dict = {}  # (variant key, device) -> launcher entry


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s stream (a debug check's host sync
    would break the capture, so it is skipped there)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def fused_qk_norm_rope(q, k, positions, q_weight, k_weight, table, eps: float, *, pdl: bool = True):
    """(q_out, k_out): every head row of q [T, heads, D] and k [T, kv_heads, D] normalized over D
    (fp32, times its weight, rounded once), then rotated by `table[positions]` (neox halves; fp32,
    rounded once). q and k may be row-strided views (a fused projection's output); the outputs
    are new contiguous tensors. positions: int64 [T], each below table.shape[0]: the kernel does
    not check (the core's static cache is never longer than the table); LAYER_BOUNDARY_DEBUG=1
    checks on the host (a device sync) and raises."""
    dtype, device, D = q.dtype, q.device, q.shape[-1]
    T = q.shape[0]
    if not (_heads_ok(q, dtype, device, D) and _heads_ok(k, dtype, device, D) and k.shape[0] == T):
        check_geometry(dtype, D)
        for name, t in (("q", q), ("k", k)):
            if not _heads_ok(t, dtype, device, D):
                _explain(name, t, dtype, device, D)
        raise ValueError(f"q has {T} tokens, k {k.shape[0]}")
    if not (positions.dtype == torch.int64 and positions.shape == (T,) and positions.is_contiguous() and positions.device == device):
        raise ValueError(f"positions must be int64 [{T}] contiguous on {device}, got {positions.dtype} {tuple(positions.shape)} on {positions.device}")
    if _launch.DEBUG and T and not _capturing(device) and not 0 <= int(positions.min()) <= int(positions.max()) < table.shape[0]:
        raise ValueError(
            f"positions span {int(positions.min())}..{int(positions.max())} but the table covers 0..{table.shape[0] - 1}: "
            "build rope_cos_sin_table for more positions (the kernel reads table[position] unchecked)"
        )
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not (w.dtype == dtype and w.shape == (D,) and w.is_contiguous() and w.data_ptr() % 16 == 0 and w.device == device):
            raise ValueError(f"{name} must be a contiguous, 16-byte aligned [{D}] {dtype} tensor on {device}, "
                             f"got {w.dtype} {tuple(w.shape)} on {w.device}")
    if not (table.dtype == torch.float32 and table.dim() == 2 and table.shape[1] == D and table.is_contiguous() and table.device == device):
        raise ValueError(f"table must be float32 [max_positions, {D}] contiguous on {device} (rope_cos_sin_table), "
                         f"got {table.dtype} {tuple(table.shape)} on {table.device}")
    heads, kv_heads = q.shape[1], k.shape[1]
    q_out = torch.empty((T, heads, D), dtype=dtype, device=device)
    k_out = torch.empty((T, kv_heads, D), dtype=dtype, device=device)
    if T == 0:
        return q_out, k_out
    key = ("qk_norm_rope", dtype, D, heads, kv_heads, bool(pdl))
    entry = _entries.get((key, device))
    if entry is None:
        check_geometry(dtype, D)
        entry = _entries[(key, device)] = _entry(dtype, D, heads, kv_heads, device, bool(pdl))
    addresses = [q.data_ptr(), k.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), table.data_ptr(), positions.data_ptr(),
                 q_out.data_ptr(), k_out.data_ptr()]
    launch_args(entry, T * (heads + kv_heads), (*addresses, T, q.stride(0), k.stride(0), float(eps)), device)
    return q_out, k_out
