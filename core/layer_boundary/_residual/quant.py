"""Quantizing reads: RMSNorm, then FP8 E4M3, so FP8 GEMMs get their input without a second pass.

`prepare()` returns an `Fp8Input` (the E4M3 tensor and its scale) instead of a normalized tensor.
Two formats:
- `fp8_static`: one per-tensor scale fixed at construction (calibrated offline);
- `fp8_dynamic`: one scale per token, amax(|y|) / 448, computed from the row.

The unfused reference: the sum is formed in fp32 (as the plain add + norm), the norm output y is
kept in fp32 (gamma applied in fp32, no intermediate rounding), then q = clamp(y / scale) cast
to E4M3. A fused kernel is equivalent when it quantizes the same fp32 y; candidates declare the
format they produce (`FusedMlpInput.output_format`) and the planner offers a read only the
candidates whose format matches.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ResidualOps
from .add_norm import PLAIN_ADD, GemmaRMSNorm, _acc_dtype

__all__ = ["Fp8Input", "QuantNormRead", "FP8_MAX", "fp8_residual", "quantize_fp8", "norm_fp32"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FORMATS = ("fp8_static", "fp8_dynamic")


class Fp8Input:
    """A quantized compute input: `data` (E4M3, [T, H]) and `scale` (a 0-d tensor, or [T, 1]).

    `dequantize()` gives data * scale in `dtype` (the activation dtype it replaces). Row moves
    (`map_rows`) move per-token scales with their rows.
    """

    __slots__ = ("data", "scale", "dtype")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.data = data
        self.scale = scale
        self.dtype = dtype

    @property
    def shape(self):
        return self.data.shape

    @property
    def per_token(self) -> bool:
        return self.scale.dim() > 0

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale).to(dtype or self.dtype)

    def map_rows(self, fn) -> "Fp8Input":
        """The same rows moved by `fn` (a gather or a slice over dim 0)."""
        data = fn(self.data.view(torch.uint8)).view(FP8_DTYPE)  # collectives move bytes
        scale = fn(self.scale) if self.per_token else self.scale
        return Fp8Input(data, scale, self.dtype)

    def __repr__(self) -> str:
        kind = "per-token" if self.per_token else "per-tensor"
        return f"Fp8Input({tuple(self.data.shape)}, {kind} scale)"


def norm_fp32(norm, total: torch.Tensor) -> torch.Tensor:
    """The norm's output kept in fp32: normalize in the norm's compute dtype, gamma in fp32."""
    xc = total.to(norm.compute_dtype)
    normalized = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + norm.eps)).to(torch.float32)
    if isinstance(norm, GemmaRMSNorm):
        return normalized * (1.0 + norm.weight.to(torch.float32))
    return normalized * norm.weight.to(torch.float32)


def quantize_fp8(y: torch.Tensor, out_dtype: torch.dtype, static_scale: Optional[torch.Tensor]) -> Fp8Input:
    """E4M3 of an fp32 tensor: with a fixed per-tensor scale, or per-token amax / 448."""
    if static_scale is not None:
        scale = static_scale.to(device=y.device, dtype=torch.float32)
    else:
        amax = y.abs().amax(dim=-1, keepdim=True).to(torch.float32)
        scale = torch.clamp(amax, min=1e-12) / FP8_MAX
    data = torch.clamp(y / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Input(data, scale, out_dtype)


class QuantNormRead:
    """RMSNorm then FP8 quantization; the residual stays in the activation dtype."""

    plain_norm = False
    before_gather = False

    def __init__(self, fmt: str, static_scale: Optional[float] = None):
        if fmt not in FORMATS:
            raise ValueError(f"quantizing read format must be one of {FORMATS}, got {fmt!r}")
        if (fmt == "fp8_static") != (static_scale is not None):
            raise ValueError("fp8_static needs static_scale=<float>; fp8_dynamic takes none")
        self.quant_format = fmt
        self._scale = None if static_scale is None else torch.tensor(float(static_scale), dtype=torch.float32)

    @property
    def static_scale(self) -> Optional[torch.Tensor]:
        """The fixed per-tensor scale (a 0-d float32 tensor) of `fp8_static`; None for dynamic."""
        return self._scale

    def enter(self, hidden):
        return hidden

    def _quantize(self, norm, total, dtype) -> Fp8Input:
        return quantize_fp8(norm_fp32(norm, total), dtype, self._scale)

    def read(self, residual, norm):
        return self._quantize(norm, residual, residual.dtype), residual

    def update_and_read(self, update, contribution, residual, norm):
        if update.plain_add:
            total = contribution.to(_acc_dtype(contribution.dtype)) + residual.to(_acc_dtype(residual.dtype))
            return self._quantize(norm, total, residual.dtype), total.to(residual.dtype)
        new_residual = update.apply(contribution, residual)
        return self._quantize(norm, new_residual, residual.dtype), new_residual

    def __repr__(self) -> str:
        return f"QuantNormRead({self.quant_format})"


def fp8_residual(fmt: str = "fp8_dynamic", *, static_scale: Optional[float] = None, attention: bool = True, ffn: bool = True) -> ResidualOps:
    """The plain residual with FP8 reads at attention and/or FFN inputs."""
    from .add_norm import NORM_READ

    read = QuantNormRead(fmt, static_scale)
    return ResidualOps(
        name=f"core.plain_{fmt}",
        attn_read=read if attention else NORM_READ,
        attn_update=PLAIN_ADD,
        ffn_read=read if ffn else NORM_READ,
        ffn_update=PLAIN_ADD,
    )
