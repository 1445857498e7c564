"""Weight loading and random weights of olmo2, gpt_neox and cohere (`residual_models.ResidualCausalLM`):
their Hugging Face weight names (the embedded tiny configs are in `presets`)."""

from __future__ import annotations

import torch

from layer_boundary.plugin import loads_weights

from .residual_config import ResidualConfig

__all__ = ["load_weights", "random_weights"]

#: where each family's tensors live: (layer prefix, embedding, final norm)
_NAMES = {
    "olmo2": ("model.layers", "model.embed_tokens", "model.norm"),
    "gpt_neox": ("gpt_neox.layers", "gpt_neox.embed_in", "gpt_neox.final_layer_norm"),
    "cohere": ("model.layers", "model.embed_tokens", "model.norm"),
}


def _norm_tensors(src, name: str, norm, to) -> None:
    norm.weight.copy_(to(src.require(f"{name}.weight")))
    if getattr(norm, "bias", None) is not None:
        norm.bias.copy_(to(src.require(f"{name}.bias")))


def _neox_qkv(fused: torch.Tensor, heads: int, head_dim: int) -> tuple:
    """GPT-NeoX's fused query_key_value rows are [head, (q | k | v), channel]: the q, k and v
    rows of every head, each [heads * head_dim, ...]."""
    per_head = fused.reshape(heads, 3, head_dim, *fused.shape[1:])
    return tuple(per_head[:, i].reshape(heads * head_dim, *fused.shape[1:]) for i in range(3))


@loads_weights
@torch.no_grad()
def load_weights(model, src) -> None:
    """Copy every weight of a `ResidualCausalLM` from `src` (Hugging Face names), sharded per rank."""
    cfg = model.config
    ref = next(model.parameters())
    layers, embed, final = _NAMES[cfg.model_type]

    def to(t):
        return t.to(dtype=ref.dtype, device=ref.device)

    if model.embed_tokens is not None:
        model.embed_tokens.weight.copy_(to(src.require(f"{embed}.weight")))
    if model.lm_head is not None:
        _norm_tensors(src, final, model.norm, to)
        if not cfg.tie_word_embeddings:
            head = src.get("embed_out.weight") if cfg.model_type == "gpt_neox" else None  # GPT-NeoX's older name
            model.lm_head.weight.copy_(to(head if head is not None else src.require("lm_head.weight")))
        elif model.embed_tokens is None:  # the last stage's own copy of a tied head
            model.lm_head.weight.copy_(to(src.require(f"{embed}.weight")))
    for i, layer in zip(model.layer_ids, model.layers):
        p = f"{layers}.{i}"
        attn = layer.self_attn
        if cfg.model_type == "gpt_neox":
            q, k, v = _neox_qkv(to(src.require(f"{p}.attention.query_key_value.weight")), cfg.num_heads, cfg.head_dim)
            o = to(src.require(f"{p}.attention.dense.weight"))
            biases = None
            if cfg.attention_bias:
                qb, kb, vb = _neox_qkv(to(src.require(f"{p}.attention.query_key_value.bias")), cfg.num_heads, cfg.head_dim)
                biases = (qb, kb, vb, to(src.require(f"{p}.attention.dense.bias")))
            attn.load(q, k, v, o, biases)
            m = f"{p}.mlp"
            layer.mlp.load_full(
                to(src.require(f"{m}.dense_h_to_4h.weight")), to(src.require(f"{m}.dense_4h_to_h.weight")),
                to(src.require(f"{m}.dense_h_to_4h.bias")), to(src.require(f"{m}.dense_4h_to_h.bias")),
            )
        else:
            a = f"{p}.self_attn"
            q, k, v, o = (to(src.require(f"{a}.{n}_proj.weight")) for n in "qkvo")
            biases = tuple(to(src.require(f"{a}.{n}_proj.bias")) for n in "qkvo") if cfg.attention_bias else None
            norms = (to(src.require(f"{a}.q_norm.weight")), to(src.require(f"{a}.k_norm.weight"))) if cfg.qk_norm else (None, None)
            attn.load(q, k, v, o, biases, *norms)
            layer.mlp.load_full(*(to(src.require(f"{p}.mlp.{n}_proj.weight")) for n in ("gate", "up", "down")))
        for name in ("input_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"):
            norm = getattr(layer, name, None)
            if norm is not None:
                _norm_tensors(src, f"{p}.{name}", norm, to)


def random_weights(config: ResidualConfig, dtype: torch.dtype, seed: int) -> dict:
    """A seeded random state dict with Hugging Face names: linear weights of std 1/sqrt(fan_in),
    embeddings of std 1, norm weights 1 + 0.1 N(0, 1), and every bias 0.1 N(0, 1) (non-zero, so
    a bias added twice or never shows)."""
    gen = torch.Generator().manual_seed(seed)
    H, D, V, I = config.hidden_size, config.head_dim, config.vocab_size, config.intermediate_size
    layers, embed, final = _NAMES[config.model_type]

    def linear(out_f, in_f):
        return torch.randn(out_f, in_f, generator=gen) / in_f**0.5

    def small(*shape):
        return 0.1 * torch.randn(*shape, generator=gen)

    def norm(name, *shape, bias=False):
        state[f"{name}.weight"] = 1.0 + small(*shape)
        if bias:
            state[f"{name}.bias"] = small(*shape)

    neox = config.model_type == "gpt_neox"
    state = {f"{embed}.weight": torch.randn(V, H, generator=gen)}
    q_out, kv_out = config.num_heads * D, config.num_kv_heads * D
    for i in range(config.num_layers):
        p = f"{layers}.{i}"
        if config.model_type == "olmo2":
            norm(f"{p}.post_attention_layernorm", H)
            norm(f"{p}.post_feedforward_layernorm", H)
        else:
            norm(f"{p}.input_layernorm", H, bias=neox)
            if neox:
                norm(f"{p}.post_attention_layernorm", H, bias=True)
        if neox:
            state[f"{p}.attention.query_key_value.weight"] = linear(3 * H, H)
            state[f"{p}.attention.dense.weight"] = linear(H, H)
            if config.attention_bias:
                state[f"{p}.attention.query_key_value.bias"] = small(3 * H)
                state[f"{p}.attention.dense.bias"] = small(H)
            state[f"{p}.mlp.dense_h_to_4h.weight"] = linear(I, H)
            state[f"{p}.mlp.dense_h_to_4h.bias"] = small(I)
            state[f"{p}.mlp.dense_4h_to_h.weight"] = linear(H, I)
            state[f"{p}.mlp.dense_4h_to_h.bias"] = small(H)
            continue
        a = f"{p}.self_attn"
        for name, out_f, in_f in (("q", q_out, H), ("k", kv_out, H), ("v", kv_out, H), ("o", H, q_out)):
            state[f"{a}.{name}_proj.weight"] = linear(out_f, in_f)
            if config.attention_bias:
                state[f"{a}.{name}_proj.bias"] = small(out_f)
        if config.qk_norm == "projection":
            norm(f"{a}.q_norm", q_out)
            norm(f"{a}.k_norm", kv_out)
        elif config.qk_norm == "head":
            norm(f"{a}.q_norm", config.num_heads, D)
            norm(f"{a}.k_norm", config.num_kv_heads, D)
        state[f"{p}.mlp.gate_proj.weight"] = linear(I, H)
        state[f"{p}.mlp.up_proj.weight"] = linear(I, H)
        state[f"{p}.mlp.down_proj.weight"] = linear(H, I)
    norm(final, H, bias=neox)
    state["lm_head.weight"] = state[f"{embed}.weight"] if config.tie_word_embeddings else linear(V, H)
    return {k: v.to(dtype) for k, v in state.items()}
