"""The plain residual: add, then a norm (RMSNorm or LayerNorm), with the add accumulated in at
least FP32.

`add_rms_norm` is the unfused reference every fused kernel is checked against: the sum is
formed in max(dtype, fp32), rounded once into the new residual, and the norm reads the
unrounded sum (as fused add+norm kernels do). The norm statistic runs in `compute_dtype`
(fp32 by default, like fused kernels and Hugging Face's RMSNorm).

What the boundaries run is `fused_add_forward`: the first `AddNormKernel` a plugin registers
that implements the norm's kind ("rms", "gemma_rms", "layer") and accepts its device and dtypes
(one fused kernel), else `add_forward` (see `kernels.py`).
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch
from torch import nn

from . import ResidualOps, kernels

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
    "kernel_refusal",
    "describe_add_norm",
    "prepare_norms",
    "has_add_norm",
    "norm_kind_of",
    "kernel_norm_kind",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _ChosenKernels(nn.Module):
    """What the core's norms share: the add + norm through the kernel chosen per device and
    dtypes (`kernels.py`), and forgetting that choice when the norm moves or is copied."""

    #: the chosen add + norm per (device, residual dtype, contribution dtype), filled by the first
    #: call on each (an instance dict then shadows this empty one; see `kernels.py`)
    _add_norm_kernels = types.MappingProxyType({})
    #: the chosen plain norm (no add) per (device, dtype), filled the same way
    _norm_kernels = types.MappingProxyType({})
    _CACHES = ("_add_norm_kernels", "_add_norm_choices", "_norm_kernels", "_norm_choices", "_post_norm_reads")

    def fused_add_forward(self, contribution: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_forward` through the chosen kernel: one fused launch where a plugin's
        `AddNormKernel` implements this norm's kind and accepts this device and these dtypes,
        else `add_forward` itself. New tensors out; the inputs are never written."""
        run = self._add_norm_kernels.get((residual.device, residual.dtype, contribution.dtype))
        if run is None:
            return kernels.first_call(self, contribution, residual)
        return run(contribution, residual)

    def add_norm_kernel(self, device=None, dtype=None) -> str:
        """The name of the add + norm this norm runs on `device` for `dtype` rows (default: its
        weight's), choosing it now if no call has."""
        device = self.weight.device if device is None else torch.device(device)
        dtype = self.weight.dtype if dtype is None else dtype
        return kernels.choose(self, device, dtype, dtype).name

    def kernel_refusal(self, plain: bool = False) -> str:
        """Why plugin kernels may not stand in for this norm's add + norm (its plain norm when
        `plain`), or "" (`kernel_refusal`)."""
        return kernel_refusal(self, plain)

    def _apply(self, fn, recurse=True):
        for cache in self._CACHES:  # moved or cast: choose again
            self.__dict__.pop(cache, None)
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = dict(super().__getstate__())
        for cache in self._CACHES:  # bound to this instance's weight: a copy chooses its own
            state.pop(cache, None)
        return state


class RMSNorm(_ChosenKernels):
    """RMSNorm, `weight * normalize(x)` (the Llama/Qwen order: round, then scale).

    `gemma_weight` is the multiplier as applied, which fused kernels take as gamma.
    `kernels=False` keeps this norm on its torch path (no plugin kernel is asked).
    """

    offset = 0.0
    #: what `AddNormRequest.norm_kind` calls this norm (kernels declare the kinds they implement)
    norm_kind = "rms"

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
            return kernels.first_norm_call(self, x)
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


class LayerNorm(_ChosenKernels):
    """LayerNorm, `(x - mean(x)) / sqrt(var(x) + eps) * weight + bias` over the last dimension,
    with or without the bias.

    The statistics and the affine run in `compute_dtype` and round once to the input's dtype (the
    order of torch's and Cohere's kernels). `compute_dtype=torch.float32` (the default, like
    `RMSNorm`) reproduces a norm that casts to fp32 first (Cohere's `CohereLayerNorm`, even in a
    float64 model); `compute_dtype=None` computes in the wider of the input's dtype and fp32, as
    `torch.nn.LayerNorm` does (GPT-NeoX). Its add + norm runs the first `AddNormKernel` that
    declares the "layer" kind and accepts (`fused_add_forward`); `kernels=False` keeps it on torch.
    """

    norm_kind = "layer"
    offset = 0.0

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True, dtype=None, device=None, compute_dtype=torch.float32,
        kernels: bool = True,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None
        self.eps = float(eps)
        self.compute_dtype = compute_dtype
        self.kernels = bool(kernels)

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

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}"


def norm_kind_of(norm) -> str:
    """What a norm module computes, as plans and fusion providers name it: "rms", "gemma_rms"
    (the `(1 + w)` scale), "layer" (the core's `LayerNorm`), "none" (a read that normalizes
    nothing: a module whose class says `norm_kind = "none"`, the identity), or "other"."""
    if isinstance(norm, (RMSNorm, LayerNorm)):
        return type(norm).norm_kind
    return "none" if getattr(type(norm), "norm_kind", None) == "none" else "other"


def kernel_norm_kind(norm) -> str:
    """`norm_kind_of(norm)`, but "other" for a core norm whose math kernels do not reproduce
    (`kernel_refusal`: a class overriding the math, `kernels=False`): what a kernel may take."""
    kind = norm_kind_of(norm)
    if kind in ("rms", "gemma_rms", "layer") and kernel_refusal(norm, plain=True):
        return "other"
    return kind


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


def kernel_refusal(norm, plain: bool = False) -> str:
    """Why `norm`'s add + norm (its plain norm when `plain`) is not the one kernels implement, or "":
    the kernels' choice (`kernels.py`) asks no record for it then."""
    cls = type(norm)
    if not getattr(norm, "kernels", True):
        return "kernels=False"
    if isinstance(norm, LayerNorm):
        if cls.forward is not LayerNorm.forward or cls.torch_forward is not LayerNorm.torch_forward:
            return f"{cls.__name__} overrides the norm"
        if cls.add_forward is not LayerNorm.add_forward or cls._normalize is not LayerNorm._normalize or cls._scale is not LayerNorm._scale:
            return f"{cls.__name__} overrides the add + norm"
        if norm.weight.dim() != 1:
            return f"{cls.__name__} has a weight of shape {tuple(norm.weight.shape)} (kernels take one row)"
        return ""
    if plain and (cls.forward is not RMSNorm.forward or cls.torch_forward is not RMSNorm.torch_forward):
        return f"{cls.__name__} overrides the norm"
    if cls.add_forward is not RMSNorm.add_forward or cls._normalize is not RMSNorm._normalize:
        return f"{cls.__name__} overrides the add + norm"
    if getattr(cls, "scale_as_kernels", False) and cls.offset in (0.0, 1.0):
        return ""  # its own scale is the kernels' (the weight in fp32, one rounding)
    if cls._scale not in (RMSNorm._scale, GemmaRMSNorm._scale) or cls.offset not in (0.0, 1.0):
        return f"{cls.__name__} scales its own way"
    if (cls._scale is GemmaRMSNorm._scale) != (cls.offset == 1.0):
        return f"{cls.__name__} mixes the Gemma scale and offset"
    return ""


def describe_add_norm(norm) -> Optional[str]:
    """One line for plans: the chain and what this norm runs for its weight's device and dtype."""
    if not has_add_norm(norm):
        return None
    weight = norm.weight
    chain = kernels.chain(type(norm).norm_kind)
    if weight.device.type == "meta":
        return f"add + {type(norm).__name__}: chosen per device and dtype at the first call; chain: {' > '.join(chain)}"
    choice = kernels.choose(norm, weight.device, weight.dtype, weight.dtype)
    why = f" ({choice.reason})" if choice.reason else (f" ({', '.join(choice.declined)} declined)" if choice.declined else "")
    return (
        f"add + {type(norm).__name__}: {choice.name}{why} on {weight.device} {str(weight.dtype).replace('torch.', '')}; "
        f"chain: {' > '.join(chain)}"
    )


def prepare_norms(model: Any) -> list[tuple[str, str]]:
    """Choose (and so compile or load) the kernels of every RMSNorm and LayerNorm in `model` for
    its weight's device and dtype, before the first forward and any CUDA-graph capture: (module
    name, kernel) for the add + norm, ("<module name> (no add)", kernel) for an RMSNorm's plain
    norm, and ("<module name> (after <post-norm>)", kernel) for the post-norm + add + norm of a
    stage reading with it."""
    if not isinstance(model, torch.nn.Module):
        return []
    out = []
    for name, module in model.named_modules():
        if has_add_norm(module) and module.weight.device.type != "meta":
            w = module.weight
            out.append((name, kernels.choose(module, w.device, w.dtype, w.dtype).name))
            if is_rms_norm(module):
                out.append((f"{name} (no add)", kernels.choose_norm(module, w.device, w.dtype).name))
        # the post-norm + add + norm of the stages reading with this norm (`post_norm.post_norm_read`)
        for read in list(module.__dict__.get("_post_norm_reads", {}).values()):
            w = read.post_norm.weight
            if w.device.type != "meta":
                out.append((f"{name} (after {type(read.post_norm).__name__})", read.choose(w.device, w.dtype, w.dtype).name))
    return out
