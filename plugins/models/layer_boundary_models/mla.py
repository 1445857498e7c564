"""Multi-head latent attention (MLA, as in DeepSeek-V3 and LongCat-Flash), heads split over
attention TP.

Queries go through a low-rank projection (q_a -> norm -> q_b); keys and values are read from a
shared compressed latent (kv_a -> norm) expanded per head by kv_b, plus one rotary key shared by
all heads. The latent projections are replicated; q_b and kv_b are split by head and o_proj by
input feature, and o_proj never reduces: the boundary owns the attention-TP sum (PARTIAL).
The KV cache keeps the compressed latent and the rotary key, not the expanded heads.
LongCat scales the query by sqrt(hidden / q_lora_rank) and the key latent by
sqrt(hidden / kv_lora_rank). Arithmetic follows Hugging Face's eager path (softmax in fp32, the
causal mask added as the dtype's minimum), so float64 runs agree to ~1e-15.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import ColumnParallelLinear, RowParallelLinear
from layer_boundary import RMSNorm
from .attention import KVCache, StepLayout

__all__ = ["TPLatentAttention", "apply_rotary_interleaved"]


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (x0, x1), (x2, x3), ...: each pair turns by one
    frequency; the output lists the rotated first elements, then the rotated second elements.
    x: [tokens, heads, dim]; cos/sin: [tokens, dim] holding each frequency twice (first half used)."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


class TPLatentAttention(nn.Module):
    def __init__(self, config, parallel, cache_index: int, *, dtype=None, device=None):
        super().__init__()
        group = parallel.groups["attn_tp"]
        H = config.hidden_size
        self.cache_index = cache_index
        self.heads = config.num_heads // group.size
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_dim = self.nope + self.rope
        self.kv_lora = config.kv_lora_rank
        self.scaling = self.qk_dim**-0.5
        self.q_scale = (H / config.q_lora_rank) ** 0.5
        self.kv_scale = (H / config.kv_lora_rank) ** 0.5
        self.q_a_proj = nn.Linear(H, config.q_lora_rank, bias=False, dtype=dtype, device=device)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6, dtype=dtype, device=device)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, config.num_heads * self.qk_dim, group, dtype=dtype, device=device)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora + self.rope, bias=False, dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, 1e-6, dtype=dtype, device=device)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora, config.num_heads * (self.nope + self.v_dim), group, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(config.num_heads * self.v_dim, H, group, reduce_results=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, step: StepLayout, rope: tuple, cache: Optional[KVCache]) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(T, self.heads, self.qk_dim)
        q_pass, q_rot = q.split((self.nope, self.rope), dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((self.kv_lora, self.rope), dim=-1)
        latent = self.kv_a_layernorm(latent) * self.kv_scale
        cos, sin = rope
        q_rot = apply_rotary_interleaved(q_rot * self.q_scale, cos, sin)
        k_rot = apply_rotary_interleaved(k_rot[:, None, :], cos, sin)[:, 0]
        query = torch.cat((q_pass * self.q_scale, q_rot), dim=-1)
        out = x.new_empty(T, self.heads, self.v_dim)
        for rid, start, count in zip(step.rids, step.starts, step.counts):
            lat, kr = latent[start : start + count], k_rot[start : start + count]
            if cache is not None:
                lat, kr = cache.append(self.cache_index, rid, lat[None], kr[None])
                lat, kr = lat[0], kr[0]
            total = lat.shape[0]
            kv = self.kv_b_proj(lat).view(total, self.heads, self.nope + self.v_dim)
            k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
            keys = torch.cat((k_nope, kr[:, None, :].expand(total, self.heads, self.rope)), dim=-1)
            qs = query[start : start + count].transpose(0, 1)  # [heads, count, qk]
            scores = torch.matmul(qs, keys.permute(1, 2, 0)) * self.scaling
            if count > 1:
                mask = torch.ones(count, total, dtype=torch.bool, device=x.device).tril(total - count)
                scores = scores + torch.zeros_like(mask, dtype=scores.dtype).masked_fill(~mask, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qs.dtype)
            out[start : start + count] = torch.matmul(probs, v.transpose(0, 1)).transpose(0, 1)
        return self.o_proj(out.reshape(T, self.heads * self.v_dim))
