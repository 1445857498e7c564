"""The kernels a provider or service launches, as one swappable object.

`CUTEDSL_KERNELS` are the CuTe DSL kernels (CUDA, bf16/fp16, statistics in fp32). Tests swap in
`testing.reference_kernels()` (the float64 references, any device and dtype) to run the whole
service, its decisions and its collectives on CPU ranks. Everything that differs between the two
is here: the three launches, ahead-of-time preparation, and what tensors and norms they take.

Inside a compiled region the CuTe DSL launches are custom ops (graph_ops.py, local_add_norm.py)
and `takes_rows` leaves out the 16-byte alignment test (an address is not known while tracing):
the ops copy rows that are not aligned when they run, which gives the same values.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import graph_ops
from .kernels import fused_add_rmsnorm, moe_finalize, moe_finalize_add_rmsnorm, prepare_add_rmsnorm, prepare_moe_finalize
from .kernels.norms import fused_add_norms, prepare_add_norms
from .kernels.tiling import MAX_HIDDEN, SUPPORTED_DTYPES
from .oneshot import CUDA_ONESHOT, OneShotKernels

__all__ = ["KernelSet", "CUTEDSL_KERNELS", "kernels_available", "model_kernel_reason", "trial_factory", "MoeShape"]

log = logging.getLogger("layer_boundary.cutedsl")


@dataclass(frozen=True)
class MoeShape:
    """A MoE finalize variant to prepare: dense `[T, top_k, H]` rows (a core handoff's layout)."""

    top_k: int
    shared: bool
    norm: bool  # finalize + add + norm (one rank) or finalize alone (before a collective)
    weight_offset: float = 0.0


@dataclass(frozen=True)
class KernelSet:
    name: str
    #: (x, residual, gamma, eps, out=None, *, residual_out=None, weight_offset=0.0) -> (normed, new_residual)
    fused_add_rmsnorm: Callable
    #: (routed, indices, weights, *, shared=None, out=None) -> finalized [T, H]
    moe_finalize: Callable
    #: (routed, indices, weights, residual, gamma, eps, *, shared=None, weight_offset=0.0) -> (normed, new_residual)
    moe_finalize_add_rmsnorm: Callable
    #: (dtype, hidden, device, add_norm_offsets, moe_shapes) -> None: compile and load ahead of time
    prepare: Callable
    #: whether these kernels can run in this process at all
    available: Callable[[], bool]
    #: whether a tensor is on a device the kernels run on
    on_device: Callable[[torch.Tensor], bool]
    dtypes: tuple = SUPPORTED_DTYPES
    #: the norm statistic dtypes whose semantics the kernels reproduce
    norm_compute_dtypes: tuple = (torch.float32,)
    max_hidden: int = MAX_HIDDEN
    #: the one-shot fused all-reduce over peer buffers (oneshot.py), or None: TP > 1 then runs
    #: finalize -> the group's all-reduce -> add + norm
    oneshot: Optional[OneShotKernels] = None
    #: (x, residual, gamma, beta, post_gamma, eps, post_eps, shape) -> (normed, new_residual): the
    #: norms around the add other than one RMSNorm (an RMS post-norm before it, a LayerNorm or an
    #: identity read after it; kernels/norms.py), or None where these kernels have none
    add_norms: Optional[Callable] = None
    #: (dtype, hidden, shapes, device) -> None: compile and load those `add_norms` kernels
    prepare_add_norms: Optional[Callable] = None

    def takes_rows(self, t, dtype, shape) -> bool:
        """A tensor the kernels can read as rows: that dtype and shape, on the device, contiguous,
        16-byte aligned."""
        return (
            isinstance(t, torch.Tensor)
            and t.dtype == dtype
            and tuple(t.shape) == tuple(shape)
            and self.on_device(t)
            and t.is_contiguous()
            and (torch.compiler.is_compiling() or t.data_ptr() % 16 == 0)
        )


@functools.lru_cache(maxsize=None)
def kernels_available() -> bool:
    """nvidia-cutlass-dsl importable and a CUDA device visible."""
    return importlib.util.find_spec("cutlass") is not None and torch.cuda.is_available()


def model_kernel_reason(request, shape_reason=None):
    """Why a model-wide kernel (rope-like records: a request with `device` and `dtype`) cannot
    run: the first of a device other than CUDA, a dtype the kernels do not run
    (`SUPPORTED_DTYPES`), `shape_reason` (the kernel's own), nvidia-cutlass-dsl or CUDA missing;
    None when it can."""
    if request.device.type != "cuda":
        return f"a {request.device.type} device"
    if request.dtype not in SUPPORTED_DTYPES:
        return f"{request.dtype}"
    if shape_reason is not None:
        return shape_reason
    if not kernels_available():
        return "nvidia-cutlass-dsl or CUDA missing"
    return None


def trial_factory(record: str, request, why: Optional[str], build: Callable, what: str):
    """A model-wide kernel record's factory: None when `why` says the kernel cannot run `request`
    (logged at debug level) or when `build()` (compile, load, one trial launch, synchronized)
    raises (a warning naming the record, `what` and the device); else the kernel `build` made, so
    that a later call may run inside a CUDA-graph capture."""
    if why is not None:
        log.debug("%s declines: %s", record, why)
        return None
    try:
        kernel = build()
        torch.cuda.synchronize(request.device)
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here declines
        log.warning("%s declines %s on %s: %s: %s", record, what, request.device, type(exc).__name__, exc)
        return None
    return kernel


def _prepare_cutedsl(dtype, hidden, device, add_norm_offsets, moe_shapes) -> None:
    for offset in sorted(set(add_norm_offsets)):
        prepare_add_rmsnorm(dtype, hidden, weight_offset=offset, device=device)
    for shape in moe_shapes:
        prepare_moe_finalize(
            dtype, hidden, shape.top_k, indexed=False, shared=shape.shared, norm=shape.norm, weight_offset=shape.weight_offset, device=device
        )


def _graph_fused_add_rmsnorm(x, residual, gamma, eps, out=None, *, residual_out=None, weight_offset=0.0):
    if torch.compiler.is_compiling() and out is None and residual_out is None:
        return torch.ops.layer_boundary_cutedsl.local_add_rmsnorm(x, residual, gamma, float(eps), float(weight_offset))
    return fused_add_rmsnorm(x, residual, gamma, eps, out, residual_out=residual_out, weight_offset=weight_offset)


def _graph_moe_finalize(routed, indices, weights, *, shared=None, out=None):
    if torch.compiler.is_compiling() and indices is None and routed.dim() == 3:
        return graph_ops.MOE_FINALIZE(routed, weights, shared)  # `out` (a reused buffer) is the eager path's
    return moe_finalize(routed, indices, weights, shared=shared, out=out)


def _graph_moe_finalize_add_rmsnorm(routed, indices, weights, residual, gamma, eps, *, shared=None, weight_offset=0.0,
                                    out=None, residual_out=None):
    if torch.compiler.is_compiling() and indices is None and routed.dim() == 3 and out is None and residual_out is None:
        return graph_ops.MOE_FINALIZE_ADD_RMSNORM(routed, weights, shared, residual, gamma, float(eps), float(weight_offset))
    return moe_finalize_add_rmsnorm(routed, indices, weights, residual, gamma, eps, shared=shared, weight_offset=weight_offset,
                                    out=out, residual_out=residual_out)


def _graph_add_norms(x, residual, gamma, beta, post_gamma, eps, post_eps, shape):
    if torch.compiler.is_compiling():
        from .local_add_norm import graph_add_norms

        return graph_add_norms(x, residual, gamma, beta, post_gamma, eps, post_eps, shape)
    return fused_add_norms(x, residual, gamma, beta, post_gamma, eps, post_eps, shape)


def _prepare_add_norms(dtype, hidden, shapes, device) -> None:
    prepare_add_norms(dtype, hidden, shapes, device)


CUTEDSL_KERNELS = KernelSet(
    name="cutedsl",
    fused_add_rmsnorm=_graph_fused_add_rmsnorm,
    moe_finalize=_graph_moe_finalize,
    moe_finalize_add_rmsnorm=_graph_moe_finalize_add_rmsnorm,
    prepare=_prepare_cutedsl,
    available=kernels_available,
    on_device=lambda t: t.is_cuda,
    oneshot=CUDA_ONESHOT,
    add_norms=_graph_add_norms,
    prepare_add_norms=_prepare_add_norms,
)

# the op `local_add_rmsnorm` the compiled add + norm calls (it imports this module: last)
from . import local_add_norm as _local_add_norm  # noqa: E402,F401
