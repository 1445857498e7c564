"""Hyper-connection residual kinds for layer-boundary: reads, updates and the stack-exit read.

`mhc` (manifold-constrained hyper-connections): the residual a stage's read leaves in the stream
is a tuple of row tensors `(streams [T, n, H], post [T, n], comb [T, n, n])`. `ihc` (independent
hyper-connections, no mixing matrix) leaves `(streams, post)`. The coefficients a read computed
travel with their token rows (any row move of the residual moves them too) until the same
stage's update consumes them. Nothing per token is stored on the layer, so reads and updates are
stateless and one layer may serve several microbatches.

The updates are not plain adds: they must see the completed sum (after all-reduce or
reduce-scatter), they widen the residual from H to n*H, and the next read is a nonlinear function
of the whole residual, so the boundary never adds them on one rank before a sum and never hands
them to a fused add+norm kernel.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from layer_boundary import ResidualOps

from .mapping import (
    check_mapping,
    collapse,
    expand,
    head_weights,
    independent_coefficients,
    independent_head_weights,
    inject,
    stage_coefficients,
    write_back,
)

__all__ = ["MhcRead", "IhcRead", "MhcUpdate", "IhcUpdate", "StreamsExitRead", "build_mhc", "build_ihc", "streams_of"]

MHC_NAME = "mhc.torch"
IHC_NAME = "mhc.ihc_torch"


def streams_of(residual: Any) -> torch.Tensor:
    """The [T, n, H] streams of a residual value (a bare tensor, or the tuple a read left)."""
    streams = residual[0] if isinstance(residual, tuple) else residual
    if not isinstance(streams, torch.Tensor) or streams.dim() != 3:
        shape = tuple(streams.shape) if isinstance(streams, torch.Tensor) else type(streams).__name__
        raise ValueError(f"a hyper-connection residual is [tokens, streams, hidden], got {shape}; enter the stack through its read")
    return streams


class _Settings:
    __slots__ = ("streams", "iters", "eps", "rms_eps", "magnitude")

    def __init__(self, streams: int, eps: float, rms_eps: float, *, iters: int = 0, magnitude: float = 2.0):
        self.streams = streams
        self.iters = iters
        self.eps = eps
        self.rms_eps = rms_eps
        self.magnitude = magnitude


class _StreamsRead:
    """A stage's read over n streams: coefficients from the complete streams, the pre-weighted
    collapse rounded once, then the stage's own norm. It runs on the rows the residual lives on
    (before any DP gather of the input)."""

    plain_norm = False
    before_gather = True

    def __init__(self, mapping, settings: _Settings, where: str):
        self.mapping = mapping
        self.settings = settings
        self.where = where

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        return expand(hidden, self.settings.streams)

    def update_and_read(self, update, contribution, residual, norm):
        # no fusion: the update completes (one rounding), then the read sees the rounded streams
        return self.read(update.apply(contribution, residual), norm)

    def _streams(self, residual) -> torch.Tensor:
        streams = streams_of(residual)
        if streams.shape[1] != self.settings.streams:
            raise ValueError(f"{self!r} expects {self.settings.streams} streams, the residual has {streams.shape[1]}")
        return streams

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where}, n={self.settings.streams})"


class MhcRead(_StreamsRead):
    def read(self, residual, norm):
        streams = self._streams(residual)
        s, m = self.settings, self.mapping
        coeffs = stage_coefficients(streams, m.fn, m.base, m.scale, iters=s.iters, eps=s.eps, rms_eps=s.rms_eps)
        return norm(collapse(streams, coeffs.pre)), (streams, coeffs.post, coeffs.comb)


class IhcRead(_StreamsRead):
    def read(self, residual, norm):
        streams = self._streams(residual)
        s, m = self.settings, self.mapping
        pre, post = independent_coefficients(streams, m.fn, m.base, m.scale, magnitude=s.magnitude, eps=s.eps, rms_eps=s.rms_eps)
        return norm(collapse(streams, pre)), (streams, post)


def _coefficients_of(kind: str, residual, arity: int, contribution: torch.Tensor) -> tuple:
    if not (isinstance(residual, tuple) and len(residual) == arity):
        raise ValueError(
            f"an {kind} update needs the coefficients its stage's read left in the residual; this residual has none: declare "
            f"the stage's read and update with the same residual_kind({kind!r}, ...)"
        )
    if contribution.shape[0] != residual[0].shape[0]:
        raise ValueError(
            f"{kind} update: the output has {contribution.shape[0]} rows but the residual {residual[0].shape[0]}; the output "
            "must be complete and on the residual's rows"
        )
    return residual


class MhcUpdate:
    """X' = post F + comb^T X with the coefficients the same stage's read left in the residual."""

    plain_add = False
    at_producer = False
    #: the coefficients live in the residual, not on the layer: the sum may complete at the next input
    outlives_layer = True

    def apply(self, contribution: torch.Tensor, residual) -> torch.Tensor:
        streams, post, comb = _coefficients_of("mhc", residual, 3, contribution)
        return write_back(contribution, streams, post, comb)

    def __repr__(self) -> str:
        return "MHC_UPDATE"


class IhcUpdate:
    """X'[i] = post[i] F + X[i] with the read's post gates (no stream mixing)."""

    plain_add = False
    at_producer = False
    outlives_layer = True

    def apply(self, contribution: torch.Tensor, residual) -> torch.Tensor:
        streams, post = _coefficients_of("ihc", residual, 2, contribution)
        return inject(contribution, streams, post)

    def __repr__(self) -> str:
        return "IHC_UPDATE"


class StreamsExitRead:
    """The stack exit: contract the streams (learned head weights, or their mean), then the
    final norm. Accepts zero rows."""

    plain_norm = False
    before_gather = True

    def __init__(self, streams: int, weights: Optional[Callable[[torch.Tensor], torch.Tensor]], label: str):
        self.streams = streams
        self.weights = weights
        self.label = label

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        return expand(hidden, self.streams)

    def contract(self, streams: torch.Tensor) -> torch.Tensor:
        return streams.mean(dim=1) if self.weights is None else collapse(streams, self.weights(streams))

    def read(self, residual, norm):
        streams = streams_of(residual)
        return norm(self.contract(streams)), streams

    def update_and_read(self, update, contribution, residual, norm):
        return self.read(update.apply(contribution, residual), norm)

    def __repr__(self) -> str:
        return f"StreamsExitRead({self.label})"


MHC_UPDATE = MhcUpdate()
IHC_UPDATE = IhcUpdate()


def _check_common(kind, streams, attn, ffn, head, rows: int, scales: int) -> None:
    if not isinstance(streams, int) or streams < 1:
        raise ValueError(f"{kind} needs streams >= 1, got {streams!r}")
    hidden = {check_mapping(f"{kind} attn", attn, streams, rows, scales), check_mapping(f"{kind} ffn", ffn, streams, rows, scales)}
    if head is not None:
        hidden.add(check_mapping(f"{kind} head", head, streams, streams, 1))
    if len(hidden) != 1:
        raise ValueError(f"the {kind} mappings disagree on the hidden size: {sorted(hidden)}")


def _streams_ops(name: str, read_type, update, head_fn, settings: _Settings, attn, ffn, head) -> ResidualOps:
    """The residual kind `name` over `settings.streams` streams: both stages read with `read_type`
    and update with `update`; the stack leaves through `head_fn` of the learned head, or the
    streams' mean without one."""
    weights = None
    if head is not None:

        def weights(x, _h=head, _s=settings, _f=head_fn):
            return _f(x, _h.fn, _h.base, _h.scale, eps=_s.eps, rms_eps=_s.rms_eps)

    return ResidualOps(
        name=name,
        attn_read=read_type(attn, settings, "attn"),
        attn_update=update,
        ffn_read=read_type(ffn, settings, "ffn"),
        ffn_update=update,
        supports_slices=True,
        final_read=StreamsExitRead(settings.streams, weights, "head" if head is not None else "mean"),
    )


def build_mhc(
    *,
    streams: int,
    attn,
    ffn,
    head: Optional[Any] = None,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
    rms_eps: float = 1e-6,
) -> ResidualOps:
    """The mhc residual kind of one layer.

    `attn` / `ffn` hold the stage mappings (tensors `fn [(2 + n) n, n H]`, `base [(2 + n) n]`,
    `scale [3]`, read at call time so weights may load after construction); `head` holds the
    learned exit contraction (`fn [n, n H]`, `base [n]`, `scale [1]`; DeepSeek-V4), or None to
    leave the stack through the streams' mean (GLM-5-Next). `eps` is the gate and Sinkhorn
    epsilon, `rms_eps` the flattened RMS epsilon (the model's rms_norm_eps).
    """
    if not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
        raise ValueError(f"mhc needs sinkhorn_iters >= 1, got {sinkhorn_iters!r}")
    _check_common("mhc", streams, attn, ffn, head, (2 + streams) * streams, 3)
    settings = _Settings(streams, float(eps), float(rms_eps), iters=sinkhorn_iters)
    return _streams_ops(MHC_NAME, MhcRead, MHC_UPDATE, head_weights, settings, attn, ffn, head)


def build_ihc(
    *,
    streams: int,
    attn,
    ffn,
    head: Optional[Any] = None,
    magnitude: float = 2.0,
    eps: float = 1e-6,
    rms_eps: float = 1e-6,
) -> ResidualOps:
    """The ihc residual kind of one layer (HY-V4's independent hyper-connections).

    Mappings hold `fn [2n, n H]`, `base [2n]`, `scale [2]` (pre | post); `head` as for mhc, or
    None for the streams' mean. `magnitude` scales the post gates (2 in HY-V4).
    """
    _check_common("ihc", streams, attn, ffn, head, 2 * streams, 2)
    settings = _Settings(streams, float(eps), float(rms_eps), magnitude=float(magnitude))
    return _streams_ops(IHC_NAME, IhcRead, IHC_UPDATE, independent_head_weights, settings, attn, ffn, head)
