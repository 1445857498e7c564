"""Weight loading and seeded random weights of `gemma2` and `gemma3` (Gemma 3's text model,
model_type gemma3_text)."""

from __future__ import annotations

import torch

from layer_boundary.plugin import TensorSource, loads_weights

from .gemma2_config import GemmaSandwichConfig
from .weights import load_attention, load_stage_ends

__all__ = ["load_weights", "random_weights"]

#: a layer's norms, each a (1 + w) RMSNorm over the hidden size
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@loads_weights
@torch.no_grad()
def load_weights(model, src: TensorSource) -> None:
    """Copy every weight of a `GemmaSandwichLM` from `src` (HF names), sharded per rank: the
    layers of its pipeline stage, the embedding on the first stage, the final norm and the head
    on the last (a tied head from the embedding)."""
    ref = next(model.parameters())

    def to(t):
        return t.to(dtype=ref.dtype, device=ref.device)

    load_stage_ends(model, src, to)
    for i, layer in zip(model.layer_ids, model.layers):
        p = f"model.layers.{i}"
        for name in LAYER_NORMS:
            getattr(layer, name).weight.copy_(to(src.require(f"{p}.{name}.weight")))
        load_attention(layer.self_attn, src, f"{p}.self_attn", to)
        layer.mlp.load_full(*(to(src.require(f"{p}.mlp.{name}.weight")) for name in ("gate_proj", "up_proj", "down_proj")))


def random_weights(config: GemmaSandwichConfig, dtype: torch.dtype, seed: int) -> dict:
    """A seeded random state dict with Hugging Face names.

    Linear weights have std 1/sqrt(fan_in), embeddings std 1, so activations stay O(1) and a
    missing or doubled sum shows; every (1 + w) norm weight is 0.1 N(0, 1), so each of the four
    norms of a layer, the q/k norms and the final norm matters.
    """
    gen = torch.Generator().manual_seed(seed)
    H, D, V = config.hidden_size, config.head_dim, config.vocab_size

    def linear(out_f, in_f):
        return torch.randn(out_f, in_f, generator=gen) / in_f**0.5

    def norm(n):
        return 0.1 * torch.randn(n, generator=gen)

    state = {"model.embed_tokens.weight": torch.randn(V, H, generator=gen)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        for name in LAYER_NORMS:
            state[f"{p}.{name}.weight"] = norm(H)
        state[f"{p}.self_attn.q_proj.weight"] = linear(config.num_heads * D, H)
        state[f"{p}.self_attn.k_proj.weight"] = linear(config.num_kv_heads * D, H)
        state[f"{p}.self_attn.v_proj.weight"] = linear(config.num_kv_heads * D, H)
        state[f"{p}.self_attn.o_proj.weight"] = linear(H, config.num_heads * D)
        if config.qk_norm:
            state[f"{p}.self_attn.q_norm.weight"] = norm(D)
            state[f"{p}.self_attn.k_norm.weight"] = norm(D)
        state[f"{p}.mlp.gate_proj.weight"] = linear(config.intermediate_size, H)
        state[f"{p}.mlp.up_proj.weight"] = linear(config.intermediate_size, H)
        state[f"{p}.mlp.down_proj.weight"] = linear(H, config.intermediate_size)
    state["model.norm.weight"] = norm(H)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] if config.tie_word_embeddings else linear(V, H)
    return {k: v.to(dtype) for k, v in state.items()}
