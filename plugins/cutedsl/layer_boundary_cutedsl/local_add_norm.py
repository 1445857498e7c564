"""The cutedsl plugin's local add + norm kernels: the `AddNormKernel` records "cutedsl.add_rmsnorm"
and "cutedsl.local_norms" (`NormsFactory`, below: a LayerNorm read, and an RMS post-norm before
the add with the read's RMSNorm, LayerNorm or nothing after it).

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
from .kernels.norms import NormsShape, fused_add_norms

__all__ = [
    "AddNormFactory", "CuteAddNorm", "factory", "contract_factory", "NormsFactory", "CuteNorms", "norms_factory", "norms_contract_factory",
    "graph_add_norms",
]

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


# the LayerNorm read and the post-norm: "cutedsl.local_norms" ------------------------------------------


class CuteNorms:
    """One launch of the norms kernel (kernels/norms.py) for `shape`: as an add + LayerNorm
    `(contribution, residual, weight, bias)`, or with `post=True` as a post-norm + add + norm
    `(contribution, residual, post_weight, post_bias, weight, bias)`."""

    def __init__(self, launch, shape: NormsShape, eps: float, post_eps: float, name: str):
        self.launch = launch
        self.shape = shape
        self.eps = eps
        self.post_eps = post_eps
        self.name = name

    def __call__(self, contribution, residual, *weights):
        if self.shape.post:
            _, _, gamma, beta = weights
            post_gamma = weights[0]
        else:
            gamma, beta = weights
            post_gamma = None
        if torch.compiler.is_compiling():  # the CuTe DSL launch is one op of the graph (an address is not known while tracing)
            launch = graph_add_norms if self.launch is CUTEDSL_KERNELS.add_norms else self.launch
            return launch(contribution, residual, gamma, beta, post_gamma, self.eps, self.post_eps, self.shape)
        return self.launch(_rows(contribution), _rows(residual), gamma, beta, post_gamma, self.eps, self.post_eps, self.shape)

    def __repr__(self) -> str:
        return f"CuteNorms({self.name}, {self.shape.tag}, eps={self.eps}, post_eps={self.post_eps})"


def _norm_shape(post, norm) -> "tuple[Optional[NormsShape], str]":
    """The kernels' `NormsShape` for a post-norm spec (None: no post-norm) and a read spec, or (None, why)."""
    if post is not None and post.norm_kind not in ("rms", "gemma_rms"):
        return None, f"a {post.norm_kind} post-norm (the kernels apply an RMSNorm one)"
    kind = norm.norm_kind
    if kind not in ("rms", "gemma_rms", "layer", "none"):
        return None, f"a {kind} read"
    shape = NormsShape(
        "rms" if kind in ("rms", "gemma_rms") else kind,
        weight_offset=norm.offset if kind in ("rms", "gemma_rms") else 0.0,
        bias=norm.bias if kind == "layer" else False,
        post=post is not None,
        post_offset=post.offset if post is not None else 0.0,
    )
    return shape, ""


class NormsFactory:
    """The factories of "cutedsl.local_norms" over a `KernelSet` (the CuTe DSL kernels; tests pass
    the float64 references): `__call__` for an add + LayerNorm (`AddNormRequest` of kind
    "layer"), `post_norm_factory` for a post-norm + add + norm (`PostNormRequest`)."""

    def __init__(self, kernels: Optional[KernelSet] = None):
        self.kernels = kernels

    def reason(self, request, specs) -> Optional[str]:
        """Why these kernels cannot run `request` (its norms: `specs`), or None."""
        ks = self.kernels or CUTEDSL_KERNELS
        if ks.add_norms is None:
            return f"the {ks.name} kernels have no norms kernel"
        dtype = request.uniform_dtype
        if dtype is None:
            return "the rows and the weights differ in dtype"
        if dtype not in ks.dtypes:
            return f"{dtype} rows"
        for spec in specs:
            if spec.norm_kind != "none" and spec.compute_dtype not in ks.norm_compute_dtypes:
                return f"norm statistics in {spec.compute_dtype}"
        elem = torch.empty((), dtype=dtype).element_size()
        hidden = request.hidden_size
        if ks is CUTEDSL_KERNELS and (hidden <= 0 or hidden * elem % _VEC_BYTES or hidden > ks.max_hidden):
            return f"width {hidden}"
        if request.device.type == "meta" or not ks.on_device(torch.empty(0, device=request.device)):
            return f"a {request.device.type} device"
        if not ks.available():
            return "nvidia-cutlass-dsl or CUDA missing"
        return None

    def _build(self, request, shape: NormsShape, eps: float, post_eps: float):
        ks = self.kernels or CUTEDSL_KERNELS
        try:
            if ks.prepare_add_norms is not None:
                ks.prepare_add_norms(request.uniform_dtype, request.hidden_size, (shape,), request.device)
        except Exception as exc:  # noqa: BLE001 - a compile that fails declines (the torch path runs)
            log.warning("cutedsl.local_norms declines %s width %d on %s: compile failed: %s: %s",
                        shape.tag, request.hidden_size, request.device, type(exc).__name__, exc)
            return None
        return CuteNorms(ks.add_norms, shape, eps, post_eps, ks.name)

    def __call__(self, request):
        """An add + LayerNorm (other kinds decline: "cutedsl.add_rmsnorm" runs the RMSNorms)."""
        if request.norm_kind != "layer":
            return None
        if self.reason(request, (request,)) is not None:
            return None
        return self._build(request, NormsShape("layer", bias=request.bias), request.eps, 0.0)

    def post_norm_factory(self, request):
        """A post-norm + add + norm (an RMS post-norm; after it the read's RMSNorm, LayerNorm or nothing)."""
        shape, _ = _norm_shape(request.post, request.norm)
        if shape is None or self.reason(request, (request.post, request.norm)) is not None:
            return None
        return self._build(request, shape, request.norm.eps, request.post.eps)


#: the record's factory (the CuTe DSL kernels)
norms_factory = NormsFactory()


def post_norm_factory(request):
    return norms_factory.post_norm_factory(request)


def norms_contract_factory() -> NormsFactory:
    """The norms factory over the float64 reference kernels: what the contract suite checks on a
    machine without a GPU (its `post_norm_factory` too)."""
    from .testing import reference_kernels

    return NormsFactory(reference_kernels())


# the custom ops torch.compile traces ---------------------------------------------------------------


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


@torch.library.custom_op("layer_boundary_cutedsl::local_add_norms", mutates_args=())
def _local_add_norms(
    x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], post_gamma: Optional[torch.Tensor],
    eps: float, post_eps: float, norm: str, weight_offset: float, bias: bool, post: bool, post_offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = NormsShape(norm, weight_offset, bias, post, post_offset)
    return fused_add_norms(_rows(x), _rows(residual), gamma, beta, post_gamma, eps, post_eps, shape)


@_local_add_norms.register_fake
def _(x, residual, gamma, beta, post_gamma, eps, post_eps, norm, weight_offset, bias, post, post_offset):
    return torch.empty_like(residual, memory_format=torch.contiguous_format), torch.empty_like(
        residual, memory_format=torch.contiguous_format
    )


@torch.library.custom_op("layer_boundary_cutedsl::local_post_add", mutates_args=())
def _local_post_add(x: torch.Tensor, residual: torch.Tensor, post_gamma: torch.Tensor, post_eps: float, post_offset: float) -> torch.Tensor:
    shape = NormsShape("none", post=True, post_offset=post_offset)
    return fused_add_norms(_rows(x), _rows(residual), None, None, post_gamma, 0.0, post_eps, shape)[1]


@_local_post_add.register_fake
def _(x, residual, post_gamma, post_eps, post_offset):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


def graph_add_norms(x, residual, gamma, beta, post_gamma, eps, post_eps, shape):
    """The norms kernel as one op of a compiled graph (an identity read's op returns the new
    residual once: a custom op's two outputs may not be one tensor)."""
    if shape.norm == "none":
        new_residual = torch.ops.layer_boundary_cutedsl.local_post_add(x, residual, post_gamma, float(post_eps), float(shape.post_offset))
        return new_residual, new_residual
    return torch.ops.layer_boundary_cutedsl.local_add_norms(x, residual, gamma, beta, post_gamma if shape.post else None, float(eps),
                                                           float(post_eps), shape.norm, float(shape.weight_offset), bool(shape.bias),
                                                           bool(shape.post), float(shape.post_offset))
