"""The cutedsl plugin's local add + RMSNorm: the `AddNormKernel` record "cutedsl.add_rmsnorm".

Every plain add + RMSNorm read that no fusion runs (TP=1, after an unfused all-reduce, the
final norm, Gemma norms) becomes one launch of the CuTe DSL `fused_add_rmsnorm`, out of place:
the kernel writes a new normed tensor and a new residual and reads its inputs only, so captures
and snapshots of them stay valid. On by default once the plugin is installed.

The factory declines (returns None) for what the kernel cannot run: another device than CUDA,
dtypes other than one bf16/fp16 for residual, contribution and weight, norm statistics outside
fp32, widths that do not split into 16-byte vectors, nvidia-cutlass-dsl missing, or a compile
that fails (reported once as a warning). It compiles and loads the kernel when it accepts, so a
later call may run inside a CUDA-graph capture. Under torch.compile the launch is the custom op
`layer_boundary_cutedsl::local_add_rmsnorm` (a fake implementation gives the shapes); eager
calls launch directly (a custom op's dispatch costs host time per call).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .kernel_set import CUTEDSL_KERNELS, KernelSet

__all__ = ["AddNormFactory", "CuteAddNorm", "factory", "contract_factory"]

log = logging.getLogger("layer_boundary.cutedsl")

#: bytes per vector the kernel moves: a row must be whole vectors
_VEC_BYTES = 16


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as rows the kernel reads: contiguous, 16-byte aligned (a copy only when it is not)."""
    if t.is_contiguous() and t.data_ptr() % _VEC_BYTES == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class CuteAddNorm:
    """`(contribution, residual, weight) -> (normed, new_residual)` through one kernel launch."""

    def __init__(self, launch, eps: float, offset: float, name: str):
        self.launch = launch
        self.eps = eps
        self.offset = offset
        self.name = name

    def __call__(self, contribution, residual, weight):
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_cutedsl.local_add_rmsnorm(contribution, residual, weight, self.eps, self.offset)
        return self.launch(_rows(contribution), _rows(residual), weight, self.eps, weight_offset=self.offset)

    def __repr__(self) -> str:
        return f"CuteAddNorm({self.name}, eps={self.eps}, offset={self.offset})"


class AddNormFactory:
    """The record's factory over a `KernelSet` (the CuTe DSL kernels; tests pass the float64
    references, which take any device and dtype)."""

    def __init__(self, kernels: Optional[KernelSet] = None):
        self.kernels = kernels

    def reason(self, request) -> Optional[str]:
        """Why these kernels cannot run `request` (None: they can, once compiled)."""
        ks = self.kernels or CUTEDSL_KERNELS
        dtype = request.uniform_dtype
        if dtype is None:
            return f"residual, contribution and weight differ in dtype ({request.dtype}, {request.contribution_dtype}, {request.weight_dtype})"
        if dtype not in ks.dtypes:
            return f"{dtype} rows"
        if request.compute_dtype not in ks.norm_compute_dtypes:
            return f"norm statistics in {request.compute_dtype}"
        if request.compute_dtype != torch.promote_types(dtype, torch.float32):
            # the kernels (and their float64 references) take the statistic in max(rows, float32)
            return f"norm statistics in {request.compute_dtype} for {dtype} rows"
        if request.offset not in (0.0, 1.0):
            return f"weight offset {request.offset}"
        elem = torch.empty((), dtype=dtype).element_size()
        hidden = request.hidden_size
        if ks is CUTEDSL_KERNELS and (hidden <= 0 or hidden * elem % _VEC_BYTES or hidden > ks.max_hidden):
            return f"width {hidden}"
        if request.device.type == "meta" or not ks.on_device(torch.empty(0, device=request.device)):
            return f"a {request.device.type} device"
        if not ks.available():
            return "nvidia-cutlass-dsl or CUDA missing"
        return None

    def __call__(self, request):
        reason = self.reason(request)
        if reason is not None:
            return None
        ks = self.kernels or CUTEDSL_KERNELS
        dtype = request.uniform_dtype
        try:
            ks.prepare(dtype, request.hidden_size, request.device, (request.offset,), ())
        except Exception as exc:  # noqa: BLE001 - a compile that fails declines (the torch path runs)
            log.warning("cutedsl.add_rmsnorm declines %s width %d on %s: compile failed: %s: %s",
                        dtype, request.hidden_size, request.device, type(exc).__name__, exc)
            return None
        return CuteAddNorm(ks.fused_add_rmsnorm, request.eps, request.offset, ks.name)


#: the record's factory (the CuTe DSL kernels)
factory = AddNormFactory()


def contract_factory() -> AddNormFactory:
    """The factory over the float64 reference kernels (any device, any dtype): what the contract
    suite checks on a machine without a GPU."""
    from .testing import reference_kernels

    return AddNormFactory(reference_kernels())


# the custom op torch.compile traces ---------------------------------------------------------------


@torch.library.custom_op("layer_boundary_cutedsl::local_add_rmsnorm", mutates_args=())
def _local_add_rmsnorm(
    contribution: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return CUTEDSL_KERNELS.fused_add_rmsnorm(_rows(contribution), _rows(residual), weight, eps, weight_offset=offset)


@_local_add_rmsnorm.register_fake
def _(contribution, residual, weight, eps, offset):
    return torch.empty_like(residual, memory_format=torch.contiguous_format), torch.empty_like(
        residual, memory_format=torch.contiguous_format
    )
