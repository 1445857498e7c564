"""DeepSeek-V4's sliding-window attention, tensor-parallel over attention TP, in plain torch.

What the boundary does not own and this module implements as Hugging Face's eager path does:
a low-rank query (`q_a_proj`, RMSNorm, `q_b_proj`, a per-head unweighted RMSNorm), one shared
key/value head (K = V, RMSNorm), interleaved RoPE on the trailing `rope_head_dim` channels
(rounded through float32 as HF does, and undone on the output's rope channels), a learned sink
logit per head, a sliding window, and the grouped low-rank output projection (`o_a_proj` per
head group, then `o_b_proj`).

Sharding: query heads split over attention TP; the shared KV head, the low-rank query and the
sinks' owner heads follow; the output projection runs on this rank's heads only and returns a
partial sum (the boundary owns that sum: the stage is PARTIAL). Compressed-attention layers
(CSA / HCA) are not implemented; the config parser rejects them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from layer_boundary import ColumnParallelLinear
from layer_boundary import RMSNorm
from .attention import StepLayout

__all__ = ["InterleavedRope", "SlidingKVCache", "DeepseekV4Attention"]


class InterleavedRope(nn.Module):
    """cos/sin per position for interleaved RoPE: one angle per channel pair, computed in float32."""

    def __init__(self, rope_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(device=positions.device, dtype=torch.float)[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def _swap_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing rope channels of x [T, heads, D]; cos/sin [T, rope_dim / 2]. The
    rotation runs on the float32-rounded channels in the wider of float32 and cos's dtype."""
    cos = cos.repeat_interleave(2, dim=-1)[:, None, :]
    sin = sin.repeat_interleave(2, dim=-1)[:, None, :]
    width = cos.shape[-1]
    rope = x[..., -width:]
    rotated = (rope.float() * cos + _swap_pairs(rope).float() * sin).to(x.dtype)
    return torch.cat((x[..., :-width], rotated), dim=-1)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, the statistic in float32 (the per-head query norm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class SlidingKVCache:
    """Per layer and request, the last `window - 1` rows of the shared K (= V) head."""

    def __init__(self, num_layers: int, window: int):
        self.window = window
        self.layers: list[dict] = [dict() for _ in range(num_layers)]

    def extend(self, layer: int, rid, kv: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(kept past rows + kv, how many past rows lead it); keeps the window's tail."""
        store = self.layers[layer]
        past = store.get(rid)
        full = kv if past is None else torch.cat((past, kv))
        store[rid] = full[-(self.window - 1) :] if self.window > 1 else full[:0]
        return full, full.shape[0] - kv.shape[0]

    def clear(self) -> None:
        for store in self.layers:
            store.clear()


class DeepseekV4Attention(nn.Module):
    def __init__(self, config, parallel, layer: int, *, dtype=None, device=None):
        super().__init__()
        group = parallel.groups["attn_tp"]
        H, D = config.hidden_size, config.head_dim
        self.layer = layer
        self.group = group
        self.head_dim = D
        self.heads = config.num_heads // group.size
        self.window = config.sliding_window
        self.eps = config.rms_norm_eps
        self.scaling = D**-0.5
        self.q_a_proj = nn.Linear(H, config.q_lora_rank, bias=False, dtype=dtype, device=device)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype=dtype, device=device)
        self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, config.num_heads * D, group, dtype=dtype, device=device)
        self.kv_proj = nn.Linear(H, D, bias=False, dtype=dtype, device=device)
        self.kv_norm = RMSNorm(D, config.rms_norm_eps, dtype=dtype, device=device)
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=dtype, device=device))
        # grouped output: this rank's heads cover `blocks` equal parts of head groups
        per_group = config.num_heads // config.o_groups
        self.blocks = max(1, self.heads // per_group)
        self.block_width = self.heads * D // self.blocks
        self.first_group = group.rank * self.heads // per_group
        self.o_rank = config.o_lora_rank
        groups_here = -(-self.heads // per_group)
        self.o_a = nn.Parameter(torch.empty(self.blocks, self.o_rank, self.block_width, dtype=dtype, device=device))
        self.o_b = nn.Parameter(torch.empty(H, groups_here * self.o_rank, dtype=dtype, device=device))
        self.per_group = per_group

    def load(self, src, prefix: str, to) -> None:
        """Take this rank's share of Hugging Face's attention weights."""
        D, rank = self.head_dim, self.group.rank
        with torch.no_grad():
            self.q_a_proj.weight.copy_(to(src.require(f"{prefix}.q_a_proj.weight")))
            self.q_a_norm.weight.copy_(to(src.require(f"{prefix}.q_a_norm.weight")))
            self.q_b_proj.load_full(to(src.require(f"{prefix}.q_b_proj.weight")))
            self.kv_proj.weight.copy_(to(src.require(f"{prefix}.kv_proj.weight")))
            self.kv_norm.weight.copy_(to(src.require(f"{prefix}.kv_norm.weight")))
            sinks = to(src.require(f"{prefix}.sinks"))
            self.sinks.copy_(sinks[rank * self.heads : (rank + 1) * self.heads])
            # o_a_proj.weight is [o_groups * o_rank, per_group * D]: one [o_rank, per_group * D] block per group
            o_a = to(src.require(f"{prefix}.o_a_proj.weight")).reshape(-1, self.o_rank, self.per_group * D)
            first_col = rank * self.heads * D - self.first_group * self.per_group * D
            for b in range(self.blocks):
                g = self.first_group + b
                cols = slice(first_col, first_col + self.block_width) if self.blocks == 1 else slice(None)
                self.o_a[b].copy_(o_a[g][:, cols])
            o_b = to(src.require(f"{prefix}.o_b_proj.weight"))
            groups_here = self.o_b.shape[1] // self.o_rank
            self.o_b.copy_(o_b[:, self.first_group * self.o_rank : (self.first_group + groups_here) * self.o_rank])

    def forward(self, x: torch.Tensor, step: StepLayout, rope: tuple, cache: Optional[SlidingKVCache]) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        cos, sin = rope
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).view(T, self.heads, D)
        q = rotate_tail(unit_rms(q, self.eps), cos, sin)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)).view(T, 1, D), cos, sin)[:, 0]
        out = x.new_empty(T, self.heads, D)
        for rid, start, count in zip(step.rids, step.starts, step.counts):
            rows = slice(start, start + count)
            keys, lead = (kv[rows], 0) if cache is None else cache.extend(self.layer, rid, kv[rows])
            out[rows] = self._attend(q[rows], keys, lead).transpose(0, 1)
        out = rotate_tail(out, cos, -sin)
        grouped = torch.bmm(out.reshape(T, self.blocks, self.block_width).transpose(0, 1), self.o_a.transpose(1, 2))
        return nn.functional.linear(grouped.transpose(0, 1).reshape(T, -1), self.o_b)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, lead: int) -> torch.Tensor:
        """q [count, heads, D] at positions lead.. of `keys` [total, D]; returns [heads, count, D]."""
        count, total = q.shape[0], keys.shape[0]
        scores = torch.matmul(q.transpose(0, 1), keys.T.unsqueeze(0)) * self.scaling  # [heads, count, total]
        query_pos = torch.arange(lead, lead + count, device=q.device)[:, None]
        key_pos = torch.arange(total, device=q.device)[None, :]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - self.window)
        # masked unconditionally (adding zeros where all is visible changes no bit), so the graph
        # never depends on tensor data
        scores = scores + torch.zeros_like(visible, dtype=scores.dtype).masked_fill(~visible, torch.finfo(scores.dtype).min)
        sinks = self.sinks.to(scores.dtype)[:, None, None].expand(-1, count, 1)
        logits = torch.cat((scores, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys.unsqueeze(0))
