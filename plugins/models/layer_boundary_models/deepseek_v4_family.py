"""Registers `deepseek_v4`: the DeepSeek-V4 reference model (mHC residual, sliding-window
attention, MoE), its embedded tiny config, weight loading and seeded random weights."""

from __future__ import annotations


import torch

from layer_boundary.plugin import loads_weights

from .deepseek_v4_config import DeepseekV4Config

__all__ = ["PRESET", "FLOAT64_TOLERANCE", "load_weights", "random_weights"]

#: the float64 logit error allowed against Hugging Face: its float32 mHC projections make its
#: own float64 output move by ~2e-7 between batchings and thread counts
FLOAT64_TOLERANCE = 1e-6

#: a tiny DeepSeek-V4 that exercises every part the reference model implements: 4 streams, a
#: sliding window shorter than prompt + decode, grouped output over 2 head groups, 8 experts
PRESET = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 6,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 2.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "layer_types": ["sliding_attention"] * 3,
    "mlp_layer_types": ["moe"] * 3,
    "tie_word_embeddings": False,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 4,
}


@loads_weights
@torch.no_grad()
def load_weights(model, src) -> None:
    """Copy every weight of a `DeepseekV4ForCausalLM` from `src` (HF names), sharded per rank."""
    ref = model.embed_tokens.weight

    def to(t):
        return t.to(dtype=ref.dtype, device=ref.device)

    model.embed_tokens.weight.copy_(to(src.require("model.embed_tokens.weight")))
    model.norm.weight.copy_(to(src.require("model.norm.weight")))
    if not model.config.tie_word_embeddings:
        model.lm_head.weight.copy_(to(src.require("lm_head.weight")))
    model.hc_head.load(src, ("model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        layer.input_layernorm.weight.copy_(to(src.require(f"{p}.input_layernorm.weight")))
        layer.post_attention_layernorm.weight.copy_(to(src.require(f"{p}.post_attention_layernorm.weight")))
        layer.attn_hc.load(src, (f"{p}.attn_hc.fn", f"{p}.attn_hc.base", f"{p}.attn_hc.scale"))
        layer.ffn_hc.load(src, (f"{p}.ffn_hc.fn", f"{p}.ffn_hc.base", f"{p}.ffn_hc.scale"))
        layer.self_attn.load(src, f"{p}.self_attn", to)
        layer.mlp.load(src, f"{p}.mlp", to)


def random_weights(config: DeepseekV4Config, dtype: torch.dtype, seed: int) -> dict:
    """A seeded random state dict with Hugging Face names.

    Linear weights have std 1/sqrt(fan_in), embeddings std 1; norm weights are 1 + 0.1 N(0, 1);
    mHC projections have std 1/sqrt(n H) with biases 0.5 N and scales 1 + 0.1 N, so pre, post and
    the Sinkhorn comb differ clearly per row and stream; sinks and the router's selection bias
    are non-zero, so each of them matters.
    """
    gen = torch.Generator().manual_seed(seed)
    H, D, V, n = config.hidden_size, config.head_dim, config.vocab_size, config.hc_mult
    E, I, A = config.num_experts, config.moe_intermediate_size, config.num_heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def linear(out_f, in_f, *lead):
        return randn(*lead, out_f, in_f) / in_f**0.5

    def norm(size):
        return 1.0 + 0.1 * randn(size)

    def mapping(prefix, rows, scales, names=("fn", "base", "scale")):
        return {
            f"{prefix}.{names[0]}": linear(rows, n * H),
            f"{prefix}.{names[1]}": 0.5 * randn(rows),
            f"{prefix}.{names[2]}": 1.0 + 0.1 * randn(scales),
        }

    state = {"model.embed_tokens.weight": randn(V, H)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        state.update(
            {
                f"{a}.sinks": randn(A),
                f"{a}.q_a_proj.weight": linear(config.q_lora_rank, H),
                f"{a}.q_a_norm.weight": norm(config.q_lora_rank),
                f"{a}.q_b_proj.weight": linear(A * D, config.q_lora_rank),
                f"{a}.kv_proj.weight": linear(D, H),
                f"{a}.kv_norm.weight": norm(D),
                f"{a}.o_a_proj.weight": linear(config.o_groups * config.o_lora_rank, A * D // config.o_groups),
                f"{a}.o_b_proj.weight": linear(H, config.o_groups * config.o_lora_rank),
                f"{p}.mlp.gate.weight": linear(E, H),
                f"{p}.mlp.gate.e_score_correction_bias": 0.1 * randn(E),
                f"{p}.mlp.experts.gate_up_proj": linear(2 * I, H, E),
                f"{p}.mlp.experts.down_proj": linear(H, I, E),
                f"{p}.mlp.shared_experts.gate_proj.weight": linear(I, H),
                f"{p}.mlp.shared_experts.up_proj.weight": linear(I, H),
                f"{p}.mlp.shared_experts.down_proj.weight": linear(H, I),
                f"{p}.input_layernorm.weight": norm(H),
                f"{p}.post_attention_layernorm.weight": norm(H),
            }
        )
        state.update(mapping(f"{p}.attn_hc", (2 + n) * n, 3))
        state.update(mapping(f"{p}.ffn_hc", (2 + n) * n, 3))
    state["model.norm.weight"] = norm(H)
    state.update(mapping("model.hc_head", n, 1, names=("hc_fn", "hc_base", "hc_scale")))
    state["lm_head.weight"] = state["model.embed_tokens.weight"] if config.tie_word_embeddings else linear(V, H)
    return {k: v.to(dtype) for k, v in state.items()}
