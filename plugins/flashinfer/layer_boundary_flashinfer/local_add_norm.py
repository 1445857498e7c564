"""The flashinfer plugin's local add + RMSNorm: the `AddNormKernel` record "flashinfer.add_rmsnorm".

FlashInfer 0.7.2's `flashinfer.norm.fused_add_rmsnorm(input, residual, weight, eps)` (and
`gemma_fused_add_rmsnorm`, whose weight is the raw `w` of `1 + w`) works in place: it writes
the new residual into `residual` and the normed rows into `input`. The caller may still hold
both (a capture of the residual, a snapshot, the producer's output), so the kernel here runs on
copies the core owns: two device copies and one fused launch, returned as new tensors. (The
CuTe DSL record, out of place in one launch, ranks above it where both are installed.)

Which implementation FlashInfer dispatches to (`implementation()`): "cute-dsl" (its CuTe DSL
kernels, the default where nvidia-cutlass-dsl imports and targets the GPU) or "cuda" (its CUDA
JIT kernels: `FLASHINFER_USE_CUDA_NORM=1`, or the DSL missing).

The factory declines another device than CUDA, dtypes other than one bf16/fp16 for residual,
contribution and weight, statistics outside fp32, flashinfer missing, `LAYER_BOUNDARY_FLASHINFER=0`,
and a first launch that fails (it runs one on a row of zeros, so that a JIT build or compile
happens now and not inside a CUDA-graph capture). Under torch.compile the call is the custom op
`layer_boundary_flashinfer::local_add_rmsnorm` (with a fake implementation).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .eligibility import first_launch, flashinfer_installed, settings

__all__ = [
    "FlashInferAddNorm", "AddNormFactory", "factory", "implementation", "contract_factory", "reference_in_place",
    "FlashInferNorm", "NormFactory", "norm_factory", "reference_norm",
]

DTYPES = (torch.bfloat16, torch.float16)


def implementation(device=None) -> str:
    """The implementation `flashinfer.norm.fused_add_rmsnorm` runs on `device`: "cute-dsl" or "cuda"."""
    import flashinfer.norm as fnorm

    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    use_cuda = getattr(fnorm, "_use_cuda_norm", None)
    if use_cuda is not None:
        return "cuda" if use_cuda(device) else "cute-dsl"
    return "cuda" if getattr(fnorm, "_USE_CUDA_NORM", True) else "cute-dsl"


def _function(offset: float) -> Callable:
    import flashinfer.norm as fnorm

    return fnorm.gemma_fused_add_rmsnorm if offset else fnorm.fused_add_rmsnorm


def _owned_copies(contribution, residual):
    return contribution.clone(memory_format=torch.contiguous_format), residual.clone(memory_format=torch.contiguous_format)


class FlashInferAddNorm:
    """`(contribution, residual, weight) -> (normed, new_residual)`: FlashInfer's in-place
    kernel on copies (the inputs are never written)."""

    def __init__(self, function: Callable, eps: float, offset: float, implementation: str):
        self.function = function
        self.eps = eps
        self.offset = offset
        self.implementation = implementation

    def __call__(self, contribution, residual, weight):
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_flashinfer.local_add_rmsnorm(contribution, residual, weight, self.eps, self.offset)
        normed, new_residual = _owned_copies(contribution, residual)
        if normed.shape[0]:
            self.function(normed.view(-1, normed.shape[-1]), new_residual.view(-1, new_residual.shape[-1]), weight, self.eps)
        return normed, new_residual

    def __repr__(self) -> str:
        return f"FlashInferAddNorm({self.implementation}, eps={self.eps}, offset={self.offset})"


class AddNormFactory:
    """The record's factory. `functions(offset)` gives the in-place kernel (FlashInfer's by
    default; tests pass a reference with the same in-place contract) and `devices` the device
    types it runs on. A kernel is made after one launch on a row of zeros (`_trial`)."""

    #: what the warning of a failed first launch calls the kernel (before the dtype and width)
    what = ""

    def __init__(self, functions: Optional[Callable] = None, devices: tuple = ("cuda",), implementation_of=None):
        self.functions = functions
        self.devices = devices
        self.implementation_of = implementation_of

    def reason(self, request) -> Optional[str]:
        """Why the kernel is not asked for `request` (None: it is tried)."""
        dtype = request.uniform_dtype
        if dtype is None:
            return "residual, contribution and weight differ in dtype"
        if dtype not in DTYPES:
            return f"{dtype} rows"
        if request.compute_dtype != torch.float32:
            return f"norm statistics in {request.compute_dtype}"
        if request.offset not in (0.0, 1.0):
            return f"weight offset {request.offset}"
        if request.device.type not in self.devices:
            return f"a {request.device.type} device"
        if not settings().enabled:
            return "LAYER_BOUNDARY_FLASHINFER=0"
        if self.functions is None and not flashinfer_installed():
            return "flashinfer-python missing"
        return None

    def __call__(self, request):
        launched = first_launch("flashinfer.add_rmsnorm", f"{self.what}{request.uniform_dtype} width {request.hidden_size}",
                                request.device, lambda: self._trial(request), declined=self.reason(request))
        return None if launched is None else self._kernel(request, launched)

    def _trial(self, request):
        function = (self.functions or _function)(request.offset)
        x = torch.zeros(1, request.hidden_size, dtype=request.uniform_dtype, device=request.device)
        function(x, torch.zeros_like(x), torch.ones_like(x[0]), request.eps)
        return function, (self.implementation_of or implementation)(request.device)

    def _kernel(self, request, launched) -> FlashInferAddNorm:
        return FlashInferAddNorm(launched[0], request.eps, request.offset, launched[1])


#: the record's factory (FlashInfer's kernels)
factory = AddNormFactory()


def _norm_function(offset: float) -> Callable:
    import flashinfer.norm as fnorm

    return fnorm.gemma_rmsnorm if offset else fnorm.rmsnorm


def _plain_norm(function: Callable, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`function(rows, weight, eps) -> normed` over x's rows (a view when x is contiguous, as a
    projection's per-head view is); the result has x's shape.

    Per-head rows [tokens, heads, D] that are a slice of a fused q/k/v projection's output
    (rows strided by the fused width, so no flat view exists) go to FlashInfer as they are: its
    norms take 3-D input of any strides (its QK-norm path), where flattening would copy them."""
    if x.dim() == 3 and x.shape[0] and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and not x.is_contiguous():
        out = function(x, weight, eps)
        return out if out.is_contiguous() else out.contiguous()
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if rows.shape[0] == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return function(rows, weight, eps).view(x.shape)


class FlashInferNorm:
    """`(x, weight) -> normed`: FlashInfer's out-of-place `rmsnorm` / `gemma_rmsnorm` (Qwen3's
    per-head q/k norms, a first layer's input norm): one launch where torch runs about eight."""

    def __init__(self, function: Callable, eps: float, offset: float):
        self.function = function
        self.eps = eps
        self.offset = offset

    def __call__(self, x, weight):
        if torch.compiler.is_compiling():
            return torch.ops.layer_boundary_flashinfer.local_rmsnorm(x, weight, self.eps, self.offset)
        return _plain_norm(self.function, x, weight, self.eps)

    def __repr__(self) -> str:
        return f"FlashInferNorm(eps={self.eps}, offset={self.offset})"


class NormFactory(AddNormFactory):
    """The record's `norm_factory`: the same declines, then FlashInfer's plain norm (tests pass
    a reference `functions(offset)` with its contract)."""

    what = "the plain norm "

    def _trial(self, request):
        function = (self.functions or _norm_function)(request.offset)
        x = torch.zeros(1, request.hidden_size, dtype=request.uniform_dtype, device=request.device)
        function(x, torch.ones_like(x[0]), request.eps)
        return function

    def _kernel(self, request, function) -> FlashInferNorm:
        return FlashInferNorm(function, request.eps, request.offset)


#: the record's norm factory (FlashInfer's plain norms)
norm_factory = NormFactory()


def reference_norm(offset: float) -> Callable:
    """FlashInfer's plain-norm contract over the torch reference: new tensor, the norm in fp32
    times (weight + offset), rounded once."""

    def run(input, weight, eps):
        x = input.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)).to(input.dtype)

    return run


def reference_in_place(offset: float) -> Callable:
    """FlashInfer's in-place contract over the torch reference: `residual <- input + residual`
    (rounded once), `input <- norm(sum) * (weight + offset)`: to check the wrapper without a GPU."""
    from .testing import reference_add_norm

    def run(input, residual, weight, eps):
        normed, new_residual = reference_add_norm(input, residual, weight, eps, offset)
        residual.copy_(new_residual)
        input.copy_(normed)

    return run


def contract_factory() -> AddNormFactory:
    """The factory over `reference_in_place` on CPU rows: what the contract suite checks on a
    machine without a GPU (the copies, the in-place contract, the declines); its `norm_factory`
    is the plain norm's over `reference_norm`."""
    made = AddNormFactory(reference_in_place, devices=("cpu",), implementation_of=lambda device: "reference")
    made.norm_factory = NormFactory(reference_norm, devices=("cpu",))
    return made


# the custom op torch.compile traces ---------------------------------------------------------------


@torch.library.custom_op("layer_boundary_flashinfer::local_add_rmsnorm", mutates_args=())
def _local_add_rmsnorm(
    contribution: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, new_residual = _owned_copies(contribution, residual)
    if normed.shape[0]:
        _function(offset)(normed.view(-1, normed.shape[-1]), new_residual.view(-1, new_residual.shape[-1]), weight, eps)
    return normed, new_residual


@_local_add_rmsnorm.register_fake
def _(contribution, residual, weight, eps, offset):
    return torch.empty_like(contribution, memory_format=torch.contiguous_format), torch.empty_like(
        residual, memory_format=torch.contiguous_format
    )


@torch.library.custom_op("layer_boundary_flashinfer::local_rmsnorm", mutates_args=())
def _local_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return _plain_norm(_norm_function(offset), x, weight, eps)


@_local_rmsnorm.register_fake
def _(x, weight, eps, offset):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
