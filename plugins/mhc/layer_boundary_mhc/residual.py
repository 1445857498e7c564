"""mHC as a layer-boundary residual kind: reads, the update, and the stack-exit read.

The residual a stage's read leaves in the stream is a tuple of row tensors
`(streams [T, n, H], post [T, n], comb [T, n, n])`: the coefficients the read computed travel with
their token rows (any row move of the residual moves them too) until the same stage's update
consumes them. Nothing per token is stored on the layer, so reads and updates are stateless and
one layer may serve several microbatches.

The update is not a plain add: it must see the completed sum (after all-reduce or
reduce-scatter), it widens the residual from H to n*H, and the next read is a nonlinear function
of the whole residual, so the boundary never adds it on one rank before a sum and never hands it
to a fused add+norm kernel.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from layer_boundary import ResidualOps

from .mapping import check_mapping, collapse, expand, head_weights, stage_coefficients, write_back

__all__ = ["MhcRead", "MhcUpdate", "MhcExitRead", "build_mhc", "streams_of"]

KIND_NAME = "mhc.torch"


def streams_of(residual: Any) -> torch.Tensor:
    """The [T, n, H] streams of a residual value (a bare tensor, or the tuple a read left)."""
    streams = residual[0] if isinstance(residual, tuple) else residual
    if not isinstance(streams, torch.Tensor) or streams.dim() != 3:
        shape = tuple(streams.shape) if isinstance(streams, torch.Tensor) else type(streams).__name__
        raise ValueError(f"an mhc residual is [tokens, streams, hidden], got {shape}; enter the stack through an mhc read")
    return streams


class _Settings:
    __slots__ = ("streams", "iters", "eps", "rms_eps")

    def __init__(self, streams: int, iters: int, eps: float, rms_eps: float):
        self.streams = streams
        self.iters = iters
        self.eps = eps
        self.rms_eps = rms_eps


class MhcRead:
    """A stage's read: coefficients from the complete streams, the pre-weighted collapse rounded
    once, then the stage's own norm. Runs on the rows the residual lives on (before any DP gather
    of the input)."""

    plain_norm = False
    before_gather = True

    def __init__(self, mapping, settings: _Settings, where: str):
        self.mapping = mapping
        self.settings = settings
        self.where = where

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        return expand(hidden, self.settings.streams)

    def read(self, residual, norm):
        streams = self._check(streams_of(residual))
        s, m = self.settings, self.mapping
        coeffs = stage_coefficients(streams, m.fn, m.base, m.scale, iters=s.iters, eps=s.eps, rms_eps=s.rms_eps)
        return norm(collapse(streams, coeffs.pre)), (streams, coeffs.post, coeffs.comb)

    def update_and_read(self, update, contribution, residual, norm):
        # no fusion: the update completes (one rounding), then the read sees the rounded streams
        return self.read(update.apply(contribution, residual), norm)

    def _check(self, streams: torch.Tensor) -> torch.Tensor:
        if streams.shape[1] != self.settings.streams:
            raise ValueError(f"mhc {self.where} read expects {self.settings.streams} streams, the residual has {streams.shape[1]}")
        return streams

    def __repr__(self) -> str:
        return f"MhcRead({self.where}, n={self.settings.streams}, sinkhorn_iters={self.settings.iters})"


class MhcUpdate:
    """X' = post F + comb^T X with the coefficients the same stage's read left in the residual."""

    plain_add = False
    at_producer = False
    #: the coefficients live in the residual, not on the layer: the sum may complete at the next input
    outlives_layer = True

    def apply(self, contribution: torch.Tensor, residual) -> torch.Tensor:
        if not (isinstance(residual, tuple) and len(residual) == 3):
            raise ValueError(
                "an mhc update needs the (streams, post, comb) its stage's read left in the residual; this residual has no "
                "coefficients: declare the stage's read and update with the same residual_kind('mhc', ...)"
            )
        streams, post, comb = residual
        if contribution.shape[0] != streams.shape[0]:
            raise ValueError(
                f"mhc update: the output has {contribution.shape[0]} rows but the residual {streams.shape[0]}; the output must "
                "be complete and on the residual's rows"
            )
        return write_back(contribution, streams, post, comb)

    def __repr__(self) -> str:
        return "MHC_UPDATE"


class MhcExitRead:
    """The stack exit: contract the streams (a learned head, or their mean), then the final norm."""

    plain_norm = False
    before_gather = True

    def __init__(self, head, settings: _Settings):
        self.head = head
        self.settings = settings

    def enter(self, hidden: torch.Tensor) -> torch.Tensor:
        return expand(hidden, self.settings.streams)

    def contract(self, streams: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return streams.mean(dim=1)
        s, h = self.settings, self.head
        return collapse(streams, head_weights(streams, h.fn, h.base, h.scale, eps=s.eps, rms_eps=s.rms_eps))

    def read(self, residual, norm):
        streams = streams_of(residual)
        return norm(self.contract(streams)), streams

    def update_and_read(self, update, contribution, residual, norm):
        return self.read(update.apply(contribution, residual), norm)

    def __repr__(self) -> str:
        return f"MhcExitRead({'head' if self.head is not None else 'mean'})"


MHC_UPDATE = MhcUpdate()


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
    learned exit contraction (`fn [n, n H]`, `base [n]`, `scale [1]`), or None to leave the stack
    through the streams' mean. `eps` is the gate and Sinkhorn epsilon, `rms_eps` the flattened
    RMS epsilon (the model's rms_norm_eps).
    """
    if not isinstance(streams, int) or streams < 1:
        raise ValueError(f"mhc needs streams >= 1, got {streams!r}")
    if not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
        raise ValueError(f"mhc needs sinkhorn_iters >= 1, got {sinkhorn_iters!r}")
    n = streams
    rows = (2 + n) * n
    hidden = {check_mapping("attn", attn, n, rows, 3), check_mapping("ffn", ffn, n, rows, 3)}
    if head is not None:
        hidden.add(check_mapping("head", head, n, n, 1))
    if len(hidden) != 1:
        raise ValueError(f"mhc mappings disagree on the hidden size: {sorted(hidden)}")
    settings = _Settings(n, sinkhorn_iters, float(eps), float(rms_eps))
    return ResidualOps(
        name=KIND_NAME,
        attn_read=MhcRead(attn, settings, "attn"),
        attn_update=MHC_UPDATE,
        ffn_read=MhcRead(ffn, settings, "ffn"),
        ffn_update=MHC_UPDATE,
        supports_slices=True,
        final_read=MhcExitRead(head, settings),
    )
