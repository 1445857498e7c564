"""Attention of OLMo-2, GPT-NeoX and Cohere, heads split over attention TP.

One GEMM projects q, k and v (with their biases when the config has them), the family's q/k
norms and rotary run on this rank's heads, each request attends as Hugging Face's eager
attention does (`attention.attend_requests`; through a `StaticKVCache`, `attend_static_prefill`
and the capturable `attend_static_decode`), and the row-parallel output projection leaves its
sum to the boundary (its bias added once, on attention-TP rank 0).

The rotary embedding turns the leading `rotary_dim` channels of each head (GPT-NeoX's partial
rotary; all of them elsewhere), pairing the two halves of those channels ("half") or neighbouring
channels ("interleaved", Cohere). Where each family rounds: OLMo-2 keeps the cos/sin factors in
fp32 and rounds the rotated values once; GPT-NeoX rounds the factors to the model's dtype;
Cohere rounds q and k to fp32 before turning them (even in a float64 model).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import Linear, RowParallelLinear, shard_rows
from .attention import DecodeLayout, KVCache, StaticKVCache, attend_requests, attend_static_decode, attend_static_prefill
from .residual_norms import HeadLayerNorm, ProjectionQKNorm

__all__ = ["Rotary", "ShardedAttention"]


class Rotary(nn.Module):
    """The (cos, sin) factors of positions for one model, and the rotation its attention applies."""

    def __init__(self, config):
        super().__init__()
        dim = config.rotary_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = config.rotary_style == "interleaved"
        #: OLMo-2's factors stay fp32; the others take the model's dtype
        self.fp32_factors = config.model_type == "olmo2"
        #: Cohere turns q and k in fp32
        self.fp32_inputs = config.model_type == "cohere"

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [tokens, rotary_dim] of `positions`."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        angles = torch.repeat_interleave(freqs, 2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.fp32_factors:
            return cos, sin
        return cos.to(dtype), sin.to(dtype)

    def table(self, length: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """[length, 2, rotary_dim]: (cos, sin) of positions 0..length-1, the values `forward`
        gives them (OLMo-2's in fp32), built once for a static cache's steps to look up."""
        device = self.inv_freq.device if device is None else device
        cos, sin = self(torch.arange(length, device=device), dtype)
        return torch.stack((cos, sin), dim=1)

    def _turned(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] with its leading rotary channels turned."""
        dim = cos.shape[-1]
        rot = x[..., :dim]
        if self.fp32_inputs:
            rot = rot.float()
        c, s = cos[:, None, :], sin[:, None, :]
        turned = (rot * c + self._turned(rot) * s).to(x.dtype)
        return turned if dim == x.shape[-1] else torch.cat((turned, x[..., dim:]), dim=-1)


class ShardedAttention(nn.Module):
    """This rank's heads of one attention layer (see the module docstring).

    KV heads are split over the attention-TP group, or replicated when there are fewer of them
    than ranks (each rank then holds the one its query heads share).
    """

    def __init__(self, config, parallel, layer: int, rotary: Rotary, *, dtype=None, device=None):
        super().__init__()
        group = parallel.groups["attn_tp"]
        self.group = group
        self.layer = layer
        self.rotary = rotary
        D, H = config.head_dim, config.hidden_size
        self.head_dim = D
        self.heads = config.num_heads // group.size
        kv = config.num_kv_heads
        self.kv_heads = max(1, kv // group.size)
        self.kv_replicated = kv < group.size
        self.kv_index = group.rank // (group.size // kv) if self.kv_replicated else None
        self.scaling = D**-0.5
        self.q_width, self.kv_width = self.heads * D, self.kv_heads * D
        bias = config.attention_bias
        self.qkv_proj = Linear(H, self.q_width + 2 * self.kv_width, bias=bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(config.num_heads * D, H, group, bias=bias, reduce_results=False, dtype=dtype, device=device)
        self.qk_norm: Optional[ProjectionQKNorm] = None
        self.q_norm = self.k_norm = None
        if config.qk_norm == "projection":
            first_holder = not self.kv_replicated or group.rank % (group.size // kv) == 0
            self.qk_norm = ProjectionQKNorm(
                self.q_width, self.kv_width, config.num_heads * D, kv * D, group, config.norm_eps, counts_k=first_holder,
                dtype=dtype, device=device,
            )
        elif config.qk_norm == "head":
            self.q_norm = HeadLayerNorm(self.heads, D, config.norm_eps, dtype=dtype, device=device)
            self.k_norm = HeadLayerNorm(self.kv_heads, D, config.norm_eps, dtype=dtype, device=device)

    def kv_rows(self) -> slice:
        """The rows of the full [kv_heads * D, ...] K/V projections (and k norm) this rank holds."""
        D = self.head_dim
        if self.kv_replicated:
            return slice(self.kv_index * D, (self.kv_index + 1) * D)
        return slice(self.group.rank * self.kv_width, (self.group.rank + 1) * self.kv_width)

    def q_rows(self) -> slice:
        return slice(self.group.rank * self.q_width, (self.group.rank + 1) * self.q_width)

    @torch.no_grad()
    def load(self, q, k, v, o, biases=None, q_norm=None, k_norm=None) -> None:
        """Fill this rank's shards from the full weights: q [heads * D, H], k and v [kv_heads * D,
        H], o [H, heads * D]; `biases` (q, k, v, o) when the config has them; the q/k norm
        weights ([heads * D] and [kv_heads * D] for OLMo-2, [heads, D] and [kv_heads, D] for
        Cohere)."""
        qs, kvs = self.q_rows(), self.kv_rows()
        w, a, b = self.qkv_proj.weight, self.q_width, self.q_width + self.kv_width
        w[:a].copy_(q[qs])
        w[a:b].copy_(k[kvs])
        w[b:].copy_(v[kvs])
        self.o_proj.load_full(o, None if biases is None else biases[3])
        if biases is not None and self.qkv_proj.bias is not None:
            self.qkv_proj.bias.copy_(torch.cat((biases[0][qs], biases[1][kvs], biases[2][kvs])))
        if self.qk_norm is not None:
            self.qk_norm.q_weight.copy_(q_norm[qs])
            self.qk_norm.k_weight.copy_(k_norm[kvs])
        elif self.q_norm is not None:
            D = self.head_dim
            self.q_norm.weight.copy_(shard_rows(q_norm, self.group.rank, self.group.size))
            self.k_norm.weight.copy_(k_norm[kvs.start // D : kvs.stop // D])

    def forward(self, x: torch.Tensor, step, rope: tuple, cache: Optional[KVCache]) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        if self.qk_norm is not None:  # over the whole projections: before the split into heads
            q, k = self.qk_norm(q, k)
        q, k, v = q.reshape(T, self.heads, D), k.reshape(T, self.kv_heads, D), v.reshape(T, self.kv_heads, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        if not isinstance(cache, StaticKVCache):
            out = attend_requests(q, k, v, step, cache, self.layer, self.scaling)
        elif isinstance(step, DecodeLayout):  # fixed shapes, no host sync: capturable
            out = attend_static_decode(q, k, v, step, cache, self.layer, self.scaling)
        else:
            out = attend_static_prefill(q, k, v, step, cache, self.layer, self.scaling)
        return self.o_proj(out.reshape(T, self.heads * D))
