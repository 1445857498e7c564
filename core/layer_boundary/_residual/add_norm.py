"""The plain residual: add, then a norm (RMSNorm or LayerNorm), with the add accumulated in at
least FP32.

`add_rms_norm` is the unfused reference every fused kernel is checked against: the sum is
formed in max(dtype, fp32), rounded once into the new residual, and the norm reads the
unrounded sum (as fused add+norm kernels do). The norm statistic runs in `compute_dtype`
(fp32 by default, like fused kernels and Hugging Face's RMSNorm).

What the boundaries run is `RMSNorm.fused_add_forward`: the first `AddNormKernel` a plugin
registers that accepts the norm's device and dtypes (one fused kernel), else `add_forward`
(see `kernels.py`). `LayerNorm` runs its own torch `add_forward`: no plugin kernel declares the
LayerNorm kind yet, so none is asked.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from . import ResidualOps

__all__ = [
    "RMSNorm",
    "GemmaRMSNorm",
    "LayerNorm",
    "PlainAdd",
    "NormRead",
    "PLAIN_ADD",
    "NORM_READ",
    "PLAIN_RESIDUAL",
    "add_rms_norm",
    "add_norm",
    "is_rms_norm",
    "has_add_norm",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """RMSNorm, `weight * normalize(x)` (the Llama/Qwen order: round, then scale).

    `gemma_weight` is the multiplier as applied, which fused kernels take as gamma.
    `kernels=False` keeps this norm on its torch path (no plugin kernel is asked).
    """

    offset = 0.0
    #: what `AddNormRequest.norm_kind` calls this norm (kernels declare the kinds they implement)
    norm_kind = "rms"
    #: the chosen add + norm per (device, residual dtype, contribution dtype), filled by the first
    #: call on each (an instance dict then shadows this empty one; see `kernels.py`)
    _add_norm_kernels = types.MappingProxyType({})
    #: the chosen plain norm (no add) per (device, dtype), filled the same way
    _norm_kernels = types.MappingProxyType({})

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, dtype=None, device=None, compute_dtype=torch.float32, kernels: bool = True
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = float(eps)
        self.compute_dtype = compute_dtype
        self.kernels = bool(kernels)

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[0]

    @property
    def gemma_weight(self) -> torch.Tensor:
        """The multiplier as applied (`w`, or `1 + w` for Gemma)."""
        return self.weight + self.offset if self.offset else self.weight

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(self.compute_dtype)
        return xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)

    def _scale(self, normalized: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return self.weight * normalized.to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of x through the chosen kernel: one launch where a plugin's `AddNormKernel`
        has a `norm_factory` that accepts this device and dtype, else `torch_forward`."""
        run = self._norm_kernels.get((x.device, x.dtype))
        if run is None:
            from .kernels import first_norm_call

            return first_norm_call(self, x)
        return run(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in torch: statistics in `compute_dtype`, rounded, then scaled."""
        if x.shape[0] == 0:
            return x.new_empty(x.shape)
        return self._scale(self._normalize(x), x.dtype)

    def add_forward(self, contribution: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(c + r), c + r): the sum in max(dtype, fp32), rounded once into the residual."""
        total = contribution.to(_acc_dtype(contribution.dtype)) + residual.to(_acc_dtype(residual.dtype))
        new_residual = total.to(residual.dtype)
        if total.shape[0] == 0:
            return new_residual.new_empty(new_residual.shape), new_residual
        return self._scale(self._normalize(total), residual.dtype), new_residual

    def fused_add_forward(self, contribution: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_forward` through the chosen kernel: one fused launch where a plugin's
        `AddNormKernel` accepts this device and these dtypes, else `add_forward` itself. New
        tensors out; the inputs are never written."""
        run = self._add_norm_kernels.get((residual.device, residual.dtype, contribution.dtype))
        if run is None:
            from .kernels import first_call

            return first_call(self, contribution, residual)
        return run(contribution, residual)

    def add_norm_kernel(self, device=None, dtype=None) -> str:
        """The name of the add + norm this norm runs on `device` for `dtype` rows (default: its
        weight's), choosing it now if no call has."""
        from .kernels import choose

        device = self.weight.device if device is None else torch.device(device)
        dtype = self.weight.dtype if dtype is None else dtype
        return choose(self, device, dtype, dtype).name

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_add_norm_kernels", None)  # moved or cast: choose again
        self.__dict__.pop("_add_norm_choices", None)
        self.__dict__.pop("_norm_kernels", None)
        self.__dict__.pop("_norm_choices", None)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("_add_norm_kernels", None)  # bound to this instance's weight: a copy chooses its own
        state.pop("_add_norm_choices", None)
        state.pop("_norm_kernels", None)
        state.pop("_norm_choices", None)
        return state

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with a `(1 + w)` multiplier, scaled before rounding (the Gemma order)."""

    offset = 1.0
    norm_kind = "gemma_rms"

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, dtype=None, device=None, compute_dtype=torch.float32, kernels: bool = True
    ):
        super().__init__(hidden_size, eps, dtype=dtype, device=device, compute_dtype=compute_dtype, kernels=kernels)
        with torch.no_grad():
            self.weight.zero_()

    def _scale(self, normalized: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return (normalized * (1.0 + self.weight.to(normalized.dtype))).to(out_dtype)


class LayerNorm(nn.Module):
    """LayerNorm, `(x - mean(x)) / sqrt(var(x) + eps) * weight + bias` over the last dimension,
    with or without the bias.

    The statistics and the affine run in `compute_dtype` and round once to the input's dtype (the
    order of torch's and Cohere's kernels). `compute_dtype=torch.float32` (the default, like
    `RMSNorm`) reproduces a norm that casts to fp32 first (Cohere's `CohereLayerNorm`, even in a
    float64 model); `compute_dtype=None` computes in the wider of the input's dtype and fp32, as
    `torch.nn.LayerNorm` does (GPT-NeoX).
    """

    norm_kind = "layer"

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True, dtype=None, device=None, compute_dtype=torch.float32
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None
        self.eps = float(eps)
        self.compute_dtype = compute_dtype

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[0]

    def _compute(self, dtype: torch.dtype) -> torch.dtype:
        return _acc_dtype(dtype) if self.compute_dtype is None else self.compute_dtype

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(self._compute(x.dtype))
        centered = xc - xc.mean(-1, keepdim=True)
        return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps)

    def _scale(self, normalized: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        y = normalized * self.weight.to(normalized.dtype)
        if self.bias is not None:
            y = y + self.bias.to(normalized.dtype)
        return y.to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm in torch: statistics and affine in the compute dtype, rounded once."""
        if x.shape[0] == 0:
            return x.new_empty(x.shape)
        return self._scale(self._normalize(x), x.dtype)

    def add_forward(self, contribution: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(c + r), c + r): the sum in max(dtype, fp32), rounded once into the residual; the
        norm reads the unrounded sum (as `RMSNorm.add_forward`)."""
        total = contribution.to(_acc_dtype(contribution.dtype)) + residual.to(_acc_dtype(residual.dtype))
        new_residual = total.to(residual.dtype)
        if total.shape[0] == 0:
            return new_residual.new_empty(new_residual.shape), new_residual
        return self._scale(self._normalize(total), residual.dtype), new_residual

    def fused_add_forward(self, contribution: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the boundaries run for a plain add + LayerNorm: `add_forward` (no plugin kernel
        implements the LayerNorm kind yet)."""
        return self.add_forward(contribution, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}"


def is_rms_norm(norm) -> bool:
    """Whether `norm` is an RMSNorm whose add+norm the core (and fused kernels) can run."""
    return isinstance(norm, RMSNorm)


def has_add_norm(norm) -> bool:
    """Whether `norm` runs its own add + norm (`add_forward` / `fused_add_forward`: the sum in
    FP32, the norm of the unrounded sum): the core's `RMSNorm` family and `LayerNorm`."""
    return isinstance(norm, (RMSNorm, LayerNorm))


def add_rms_norm(norm, contribution, residual):
    """Unfused add + norm for any norm module; fused FP32 accumulation for the core's norms
    (the torch reference: never a plugin kernel)."""
    if has_add_norm(norm):
        return norm.add_forward(contribution, residual)
    new_residual = PLAIN_ADD.apply(contribution, residual)
    return norm(new_residual), new_residual


def add_norm(norm, contribution, residual):
    """What the boundaries run for a plain add + norm: the norm's chosen kernel for the core's
    norms (`fused_add_forward`), else the unfused add then the norm."""
    if has_add_norm(norm):
        return norm.fused_add_forward(contribution, residual)
    new_residual = PLAIN_ADD.apply(contribution, residual)
    return norm(new_residual), new_residual


class PlainAdd:
    """residual + contribution."""

    plain_add = True
    at_producer = False
    outlives_layer = True

    def apply(self, contribution, residual):
        total = contribution.to(_acc_dtype(contribution.dtype)) + residual.to(_acc_dtype(residual.dtype))
        return total.to(residual.dtype)

    def __repr__(self) -> str:
        return "PLAIN_ADD"


class NormRead:
    """The consumer's norm of the residual; the update and the norm fuse when both are plain."""

    plain_norm = True
    before_gather = False

    def enter(self, hidden):
        return hidden

    def read(self, residual, norm):
        return norm(residual), residual

    def update_and_read(self, update, contribution, residual, norm):
        if update.plain_add:
            return add_norm(norm, contribution, residual)
        new_residual = update.apply(contribution, residual)
        return norm(new_residual), new_residual

    def __repr__(self) -> str:
        return "NORM_READ"


PLAIN_ADD = PlainAdd()
NORM_READ = NormRead()
PLAIN_RESIDUAL = ResidualOps(
    name="core.plain", attn_read=NORM_READ, attn_update=PLAIN_ADD, ffn_read=NORM_READ, ffn_update=PLAIN_ADD
)
