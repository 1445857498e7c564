"""The arithmetic of manifold-constrained hyper-connections (mHC, arXiv 2512.24880), one token row
at a time, in plain torch.

Shapes: `streams` is [T, n, H] (n residual streams per token), a stage output `F` is [T, H].
A mapping holds `fn [(2 + n) n, n H]`, `base [(2 + n) n]` and `scale [3]`; the logits row is laid out
`pre (n) | post (n) | comb (n * n, row-major, first index = source stream)`.

Rounding order (the reference's, which Hugging Face's DeepSeek-V4 follows in float32 and float64):
- the unweighted RMS over the flattened n*H entries and the projection run in float32, whatever
  the residual's dtype;
- gates and Sinkhorn-Knopp run in the mapping parameters' dtype, at least float32;
- the collapse `sum_i pre_i X_i` and the write-back `post F + comb^T X` accumulate in at least
  float32 and are rounded once to the residual's dtype.

iHC (independent hyper-connections, HY-V4) shares the layout without `comb` (`fn [2n, n H]`,
`scale [2]`), projects before scaling by the inverse RMS (HY-V4's order), adds eps to `post`, and
writes back `post F + X`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

__all__ = [
    "Coefficients",
    "expand",
    "projected_logits",
    "scaled_projection",
    "independent_coefficients",
    "independent_head_weights",
    "sinkhorn",
    "stage_coefficients",
    "collapse",
    "write_back",
    "inject",
    "head_weights",
    "check_mapping",
]


class Coefficients:
    """Per-row coefficients of one boundary: pre [T, n], post [T, n], comb [T, n, n]."""

    __slots__ = ("pre", "post", "comb")

    def __init__(self, pre: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        self.pre = pre
        self.post = post
        self.comb = comb


def expand(hidden: torch.Tensor, n: int) -> torch.Tensor:
    """Stack entry: every stream starts as an exact copy of the embedding row. [T, H] -> [T, n, H]."""
    return hidden.unsqueeze(1).expand(hidden.shape[0], n, hidden.shape[1]).contiguous()


def projected_logits(streams: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """fn @ (x / rms(x)) per row, x the flattened streams: float32 throughout. [T, n, H] -> [T, M]."""
    flat = streams.reshape(streams.shape[0], streams.shape[1] * streams.shape[2]).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    return F.linear(flat, fn.float())


def scaled_projection(streams: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """(fn @ x) / rms(x): the same quantity projected first, then scaled (iHC's order), float32."""
    flat = streams.reshape(streams.shape[0], streams.shape[1] * streams.shape[2]).float()
    return F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)


def _gate_dtype(base: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.float32, base.dtype)


def _affine(logits: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """scale * logits + base: the product in float32 (as the projection), the sum in the gate dtype."""
    dtype = _gate_dtype(base)
    return (logits * scale.float()).to(dtype) + base.to(dtype)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on [..., n, n] logits: a row softmax (the first row step) plus eps, then column,
    and (iters - 1) times row then column normalisation, eps in every denominator. The result is
    close to doubly stochastic and not symmetric; the last step normalises columns."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def stage_coefficients(streams, fn, base, scale, *, iters: int, eps: float, rms_eps: float) -> Coefficients:
    """pre, post and comb of every row from the complete streams."""
    n = streams.shape[1]
    logits = projected_logits(streams, fn, rms_eps)
    pre = torch.sigmoid(_affine(logits[:, :n], scale[0], base[:n])) + eps
    post = 2 * torch.sigmoid(_affine(logits[:, n : 2 * n], scale[1], base[n : 2 * n]))
    comb_logits = _affine(logits[:, 2 * n :].reshape(-1, n, n), scale[2], base[2 * n :].reshape(n, n))
    return Coefficients(pre, post, sinkhorn(comb_logits, iters, eps))


def independent_coefficients(streams, fn, base, scale, *, magnitude: float, eps: float, rms_eps: float):
    """iHC (independent hyper-connections, HY-V4): (pre [T, n], post [T, n]) without a mixing
    matrix. fn [2n, n H], base [2n], scale [2]; post = magnitude * sigmoid(...) + eps."""
    n = streams.shape[1]
    logits = scaled_projection(streams, fn, rms_eps)
    pre = torch.sigmoid(_affine(logits[:, :n], scale[0], base[:n])) + eps
    post = magnitude * torch.sigmoid(_affine(logits[:, n:], scale[1], base[n:])) + eps
    return pre, post


def independent_head_weights(streams, fn, base, scale, *, eps: float, rms_eps: float) -> torch.Tensor:
    """iHC's exit contraction weights: as `head_weights`, projected first, in float32."""
    logits = scaled_projection(streams, fn, rms_eps)
    return torch.sigmoid(logits * scale.float() + base.float()) + eps


def collapse(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i X_i, accumulated in the wider of the two dtypes, rounded once. [T, n, H] -> [T, H]."""
    return (weights.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def write_back(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[o] = post[o] F + sum_i comb[i, o] X[i] in at least float32, rounded once to X's dtype."""
    acc = torch.promote_types(torch.float32, streams.dtype)
    mixed = torch.matmul(comb.to(acc).transpose(-1, -2), streams.to(acc))
    return (post.to(acc).unsqueeze(-1) * output.to(acc).unsqueeze(-2) + mixed).to(streams.dtype)


def inject(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """X'[i] = post[i] F + X[i] (iHC: no stream mixing), in at least float32, rounded once."""
    acc = torch.promote_types(torch.float32, streams.dtype)
    return (post.to(acc).unsqueeze(-1) * output.to(acc).unsqueeze(-2) + streams.to(acc)).to(streams.dtype)


def head_weights(streams, fn, base, scale, *, eps: float, rms_eps: float) -> torch.Tensor:
    """The learned stack-exit contraction weights (DeepSeek-V4's head): sigmoid gates, no
    Sinkhorn, all in float32. fn [n, n H], base [n], scale [1]. Returns [T, n]."""
    logits = projected_logits(streams, fn, rms_eps)
    return torch.sigmoid(logits * scale.float() + base.float()) + eps


def check_mapping(where: str, mapping, n: int, rows: int, scales: int) -> int:
    """Validate a mapping's fn/base/scale shapes (`where` names it: "mhc attn"); returns the hidden size."""
    for attr in ("fn", "base", "scale"):
        if not isinstance(getattr(mapping, attr, None), torch.Tensor):
            raise TypeError(f"{where} mapping needs tensors fn, base and scale; {type(mapping).__name__} has no tensor {attr!r}")
    fn, base, scale = mapping.fn, mapping.base, mapping.scale
    if fn.dim() != 2 or fn.shape[0] != rows or fn.shape[1] % n:
        raise ValueError(f"{where} mapping: fn has shape {tuple(fn.shape)}, expected [{rows}, {n} * hidden]")
    if tuple(base.shape) != (rows,):
        raise ValueError(f"{where} mapping: base has shape {tuple(base.shape)}, expected [{rows}]")
    if tuple(scale.shape) != (scales,):
        raise ValueError(f"{where} mapping: scale has shape {tuple(scale.shape)}, expected [{scales}]")
    return fn.shape[1] // n
