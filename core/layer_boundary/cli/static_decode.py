"""Fixed-shape prefill + decode through a family's static cache (`model.new_static_cache(slots,
max_len)`: what CUDA-graph decode needs).

Used by `layer-boundary bench decode` and the graph tests; the eager runner (`runner.py`)
keeps the growing per-request cache (`model.new_cache()`).
"""

from __future__ import annotations

import torch

from .._families import DecodeLayout, StepLayout
from .._forward import Forward, ForwardMode

__all__ = ["static_prefill", "static_decode_step"]


def static_prefill(model, parallel, cache, prompts, device) -> torch.Tensor:
    """Prefill request i into cache slot i; returns the logits of every prompt token."""
    slots = list(range(len(prompts)))
    step = StepLayout(slots, [len(p) for p in prompts], [0] * len(prompts), device=device)
    ids = torch.cat([torch.as_tensor(p) for p in prompts]).to(device)
    fwd = Forward(parallel, step.num_tokens, mode=ForwardMode.EXTEND)
    return model(ids, fwd, step, cache)


def static_decode_step(model, parallel, cache, input_ids, slots, positions) -> torch.Tensor:
    """One decode token per slot; fixed shapes, no host sync: capturable in a CUDA graph.
    `slots`: the cache slot of each row, or None when row i is slot i (read in place)."""
    fwd = Forward(parallel, input_ids.shape[0], mode=ForwardMode.DECODE)
    return model(input_ids, fwd, DecodeLayout(slots, positions), cache)
