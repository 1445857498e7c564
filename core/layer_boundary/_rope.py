"""The rotary table of `RopeRequest` and `QKNormRopeRequest`: what a plugin's rope kernel reads
and what the reference models' torch rotation computes its factors from."""

from __future__ import annotations

import torch

__all__ = ["rope_cos_sin_table"]


def rope_cos_sin_table(head_dim: int, theta: float, max_positions: int, device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos(p * inv_freq) in the first half, sin in the second,
    with `inv_freq = theta ** (-2i / head_dim)` computed on `device` (FlashInfer's cos_sin_cache
    layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
