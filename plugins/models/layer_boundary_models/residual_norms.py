"""The norms of OLMo-2 and Cohere that the core's `RMSNorm` and `LayerNorm` do not cover as they
are: OLMo-2's scale order, its q/k norms over whole projections split across attention-TP
ranks, and Cohere's per-head q/k LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from layer_boundary import LayerNorm, RMSNorm

__all__ = ["Olmo2RMSNorm", "ProjectionQKNorm", "HeadLayerNorm"]


class Olmo2RMSNorm(RMSNorm):
    """OLMo-2's RMSNorm: the weight multiplies the fp32 statistic's output before the one
    rounding to the input's dtype (a float64 weight keeps its precision)."""

    #: the fused add + norm kernels scale the same way (the weight in fp32, one rounding)
    scale_as_kernels = True

    def _scale(self, normalized: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return (self.weight * normalized).to(out_dtype)


class ProjectionQKNorm(nn.Module):
    """OLMo-2's q and k norms: an RMSNorm over each whole projection (every head's channels at
    once), whose channels attention TP splits over its ranks.

    Each rank sums the squares of its own q and k channels; one all_reduce of those [tokens, 2]
    sums over the attention-TP group (issued on the group the model was built with, so a
    `CountingCollectives` counts it) completes both statistics. Where KV heads are replicated
    (fewer KV heads than ranks), only the first rank holding a head counts its k channels.

    The statistic runs in `compute_dtype` (fp32, as Hugging Face's; a float64 model's is still
    rounded through fp32 there). Over one rank it is Hugging Face's computation exactly; split
    over ranks the fp32 partial sums are added in another order, so results agree to fp32
    rounding of the statistic.
    """

    def __init__(
        self, q_width: int, k_width: int, q_full: int, k_full: int, group, eps: float, *, counts_k: bool = True,
        dtype=None, device=None, compute_dtype=torch.float32,
    ):
        super().__init__()
        self.q_weight = nn.Parameter(torch.ones(q_width, dtype=dtype, device=device))
        self.k_weight = nn.Parameter(torch.ones(k_width, dtype=dtype, device=device))
        self.q_full, self.k_full = int(q_full), int(k_full)
        self.group = group
        self.eps = float(eps)
        self.counts_k = bool(counts_k)
        self.compute_dtype = compute_dtype

    @property
    def collective(self) -> str:
        """What one call issues, for plans: "" over one rank."""
        return f"all_reduce@{self.group.name} of [tokens, 2]" if self.group.size > 1 else ""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, q_width] and k [tokens, k_width], this rank's channels of the projections."""
        qc, kc = q.to(self.compute_dtype), k.to(self.compute_dtype)
        q_sum = qc.pow(2).sum(-1, keepdim=True)
        k_sum = kc.pow(2).sum(-1, keepdim=True)
        if self.group.size > 1:
            sums = self.group.all_reduce(torch.cat((q_sum, k_sum if self.counts_k else torch.zeros_like(k_sum)), dim=-1))
            q_sum, k_sum = sums[:, :1], sums[:, 1:]
        q_out = self.q_weight * (qc * torch.rsqrt(q_sum / self.q_full + self.eps))
        k_out = self.k_weight * (kc * torch.rsqrt(k_sum / self.k_full + self.eps))
        return q_out.to(q.dtype), k_out.to(k.dtype)

    def extra_repr(self) -> str:
        return f"q {self.q_weight.shape[0]} of {self.q_full}, k {self.k_weight.shape[0]} of {self.k_full}, eps={self.eps}"


class HeadLayerNorm(LayerNorm):
    """Cohere's q/k norm: a LayerNorm (no bias, fp32 statistics) over each head's channels with
    a weight of its own per head, [heads, head_dim] (this rank's heads)."""

    def __init__(self, heads: int, head_dim: int, eps: float, *, dtype=None, device=None):
        super().__init__(head_dim, eps, bias=False, dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.ones(heads, head_dim, dtype=dtype, device=device))

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[-1]
