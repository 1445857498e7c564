"""`gated_activation`: act(gate) * up in one CuTe DSL launch (torch-facing wrapper; the kernel is
gated_activation_dsl.py)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ._launch import executor_for, launch_args
from .tiling import SUPPORTED_DTYPES

__all__ = ["GatedActivationVariant", "gated_activation", "prepare_gated_activation", "check_width", "ACTIVATIONS"]

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
CTA_THREADS = 128
#: the argument types of the kernel's entry: gate_up, out, vector count, grid, stream
KINDS = ("i64", "i64", "i32", "i32", "stream")
PROBE = (0x1000, 0x1010, 7, 3, 0x5150)


@dataclass(frozen=True)
class GatedActivationVariant:
    """One compiled gated activation: dtype, activation, MLP width d, PDL launch."""

    dtype: torch.dtype
    activation: str
    intermediate: int
    pdl: bool = True
    cta_threads: int = CTA_THREADS

    def tiling(self):
        return SimpleNamespace(rows_per_cta=self.cta_threads, cta_threads=self.cta_threads)  # a "row" is one vector

    def kernel_object(self):
        from .gated_activation_dsl import GatedActivationKernel

        return GatedActivationKernel(self)

    def example_args(self):
        import cuda.bindings.driver as cuda
        from cutlass import Int32, Int64

        return [Int64(0), Int64(0), Int32(1), Int32(1), cuda.CUstream(0)]

    @property
    def name(self) -> str:
        return f"gated_{self.activation}_{str(self.dtype).split('.')[-1]}_d{self.intermediate}{'' if self.pdl else '_nopdl'}"


def check_width(dtype: torch.dtype, activation: str, intermediate: int) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"gated_activation runs bf16/fp16, not {dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated_activation runs {ACTIVATIONS}, not {activation!r}")
    if intermediate <= 0 or intermediate % 8:
        raise ValueError(f"gated_activation needs a width that is whole 16-byte vectors (a multiple of 8), not {intermediate}")


def _entry(dtype, activation, intermediate, device, pdl=True):
    key = ("gated_activation", dtype, activation, intermediate, pdl)
    return executor_for(key, device, lambda: GatedActivationVariant(dtype, activation, intermediate, pdl), 2, kinds=KINDS, probe=PROBE)


def prepare_gated_activation(dtype: torch.dtype, activation: str, intermediate: int, device=None) -> None:
    """Compile and load the kernel now (before a CUDA-graph capture)."""
    check_width(dtype, activation, intermediate)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    _entry(dtype, activation, intermediate, device)


_entries: dict = {}


def gated_activation(gate_up: torch.Tensor, activation: str = "silu", *, pdl: bool = True) -> torch.Tensor:
    """act(gate_up[..., :d]) * gate_up[..., d:] as a new [..., d] tensor (fp32 math, rounded once).
    gate_up: contiguous, 16-byte aligned; a strided one is copied first."""
    if not (gate_up.is_contiguous() and gate_up.data_ptr() % 16 == 0):
        gate_up = gate_up.clone(memory_format=torch.contiguous_format)  # a new allocation is aligned
    if gate_up.shape[-1] % 16:  # checked on every call: an odd width would share the entry of width - 1
        raise ValueError(f"gate_up's last dim must be 2 * d with d a multiple of 8 (whole 16-byte vectors), got {gate_up.shape[-1]}")
    d = gate_up.shape[-1] // 2
    out = gate_up.new_empty(gate_up.shape[:-1] + (d,))
    vectors = out.numel() // 8
    if vectors == 0:
        return out
    key = ("gated_activation", gate_up.dtype, activation, d, bool(pdl))
    device = gate_up.device
    entry = _entries.get((key, device))
    if entry is None:
        check_width(gate_up.dtype, activation, d)
        entry = _entries[(key, device)] = _entry(gate_up.dtype, activation, d, device, bool(pdl))
    launch_args(entry, vectors, (gate_up.data_ptr(), out.data_ptr(), vectors), device)
    return out
