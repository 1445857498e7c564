"""Loading Hugging Face weights into the reference decoders, each rank keeping its shard.

A source (`TensorSource`) is a state dict or a checkpoint folder; tensors are read one at a time
and sliced by the module that owns them, so a rank never holds the whole model.
MoE experts are accepted fused (`experts.gate_up_proj`, transformers 5) or per expert.
"""

from __future__ import annotations


import torch

from layer_boundary.plugin import TensorSource, loads_weights


__all__ = ["load_weights", "random_weights", "load_stage_ends", "load_attention"]


def _experts(src: TensorSource, prefix: str, num_experts: int):
    fused = src.get(f"{prefix}.experts.gate_up_proj")
    if fused is not None:
        return fused, src.require(f"{prefix}.experts.down_proj")
    gate_up, down = [], []
    for e in range(num_experts):
        p = f"{prefix}.experts.{e}"
        gate_up.append(torch.cat((src.require(f"{p}.gate_proj.weight"), src.require(f"{p}.up_proj.weight"))))
        down.append(src.require(f"{p}.down_proj.weight"))
    return torch.stack(gate_up), torch.stack(down)


def load_stage_ends(model, src: TensorSource, to) -> None:
    """The embedding on a pipeline stage that holds it, the final norm and the head on the last
    (a tied head from the embedding: the last stage's own copy where the embedding is elsewhere),
    from the `model.` names of Hugging Face decoders; `to` casts a tensor for the model."""
    if model.embed_tokens is not None:
        model.embed_tokens.weight.copy_(to(src.require("model.embed_tokens.weight")))
    if model.lm_head is not None:
        model.norm.weight.copy_(to(src.require("model.norm.weight")))
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.copy_(to(src.require("lm_head.weight")))
        elif model.embed_tokens is None:  # the last stage's own copy of a tied head
            model.lm_head.weight.copy_(to(src.require("model.embed_tokens.weight")))


def load_attention(attn, src: TensorSource, prefix: str, to) -> None:
    """A `TPAttention`'s q/k/v and output projections (and its q/k norms, where it has them)
    from the Hugging Face names under `prefix`, each rank keeping its shard."""
    attn.load_qkv(*(to(src.require(f"{prefix}.{name}.weight")) for name in ("q_proj", "k_proj", "v_proj")))
    attn.o_proj.load_full(to(src.require(f"{prefix}.o_proj.weight")))
    if attn.q_norm is not None:
        attn.q_norm.weight.copy_(to(src.require(f"{prefix}.q_norm.weight")))
        attn.k_norm.weight.copy_(to(src.require(f"{prefix}.k_norm.weight")))


@loads_weights
@torch.no_grad()
def load_weights(model, src: TensorSource) -> None:
    """Copy every weight of a reference `CausalLM` from `src` (HF names), sharded per rank: the
    layers of its pipeline stage, the embedding on the first stage, the final norm and the head
    on the last (a tied head from the embedding); a model built with LoRA adapters also gets the
    adapters its `lora_seed` draws."""
    cfg = model.config
    ref = next(model.parameters())

    def to(t):
        return t.to(dtype=ref.dtype, device=ref.device)

    load_stage_ends(model, src, to)
    for i, layer in zip(model.layer_ids, model.layers):
        p = f"model.layers.{i}"
        layer.input_layernorm.weight.copy_(to(src.require(f"{p}.input_layernorm.weight")))
        layer.post_attention_layernorm.weight.copy_(to(src.require(f"{p}.post_attention_layernorm.weight")))
        load_attention(layer.self_attn, src, f"{p}.self_attn", to)
        if cfg.is_sparse(i):
            gate_up, down = _experts(src, f"{p}.mlp", cfg.num_experts)
            shared = None
            if cfg.shared_expert_intermediate_size:
                s = f"{p}.mlp.shared_expert"
                shared = tuple(
                    to(src.require(n))
                    for n in (f"{s}.gate_proj.weight", f"{s}.up_proj.weight", f"{s}.down_proj.weight", f"{p}.mlp.shared_expert_gate.weight")
                )
            layer.mlp.load_full(to(src.require(f"{p}.mlp.gate.weight")), to(gate_up), to(down), shared)
        else:
            layer.mlp.load_full(
                to(src.require(f"{p}.mlp.gate_proj.weight")),
                to(src.require(f"{p}.mlp.up_proj.weight")),
                to(src.require(f"{p}.mlp.down_proj.weight")),
            )
    if getattr(model, "lora", None) is not None:  # the run's adapters: drawn from its seed on every rank
        from .lora_layers import load_lora, random_lora_weights

        load_lora(model, random_lora_weights(cfg, model.lora, torch.float64, model.lora_seed))


def random_weights(config, dtype: torch.dtype, seed: int) -> dict:
    """A seeded random state dict with Hugging Face names (transformers 5 layout, fused experts).

    Linear weights have std 1/sqrt(fan_in) and embeddings std 1, so activations stay O(1) and a
    missing or doubled sum shows up as a large error; norm weights are 1 + 0.1 N(0, 1) (0.1 N
    for Gemma's (1 + w)), so every norm matters.
    """
    gen = torch.Generator().manual_seed(seed)
    H, D, V = config.hidden_size, config.head_dim, config.vocab_size

    def linear(out_f, in_f, *lead):
        return torch.randn(*lead, out_f, in_f, generator=gen) / in_f**0.5

    def norm(n, gemma=config.gemma_norm):
        base = 0.0 if gemma else 1.0
        return base + 0.1 * torch.randn(n, generator=gen)

    state = {"model.embed_tokens.weight": torch.randn(V, H, generator=gen)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        state[f"{p}.input_layernorm.weight"] = norm(H)
        state[f"{p}.post_attention_layernorm.weight"] = norm(H)
        state[f"{p}.self_attn.q_proj.weight"] = linear(config.num_heads * D, H)
        state[f"{p}.self_attn.k_proj.weight"] = linear(config.num_kv_heads * D, H)
        state[f"{p}.self_attn.v_proj.weight"] = linear(config.num_kv_heads * D, H)
        state[f"{p}.self_attn.o_proj.weight"] = linear(H, config.num_heads * D)
        if config.qk_norm:
            state[f"{p}.self_attn.q_norm.weight"] = norm(D)
            state[f"{p}.self_attn.k_norm.weight"] = norm(D)
        if config.is_sparse(i):
            E, I = config.num_experts, config.moe_intermediate_size
            state[f"{p}.mlp.gate.weight"] = linear(E, H)
            state[f"{p}.mlp.experts.gate_up_proj"] = linear(2 * I, H, E)
            state[f"{p}.mlp.experts.down_proj"] = linear(H, I, E)
            if config.shared_expert_intermediate_size:
                S = config.shared_expert_intermediate_size
                state[f"{p}.mlp.shared_expert.gate_proj.weight"] = linear(S, H)
                state[f"{p}.mlp.shared_expert.up_proj.weight"] = linear(S, H)
                state[f"{p}.mlp.shared_expert.down_proj.weight"] = linear(H, S)
                state[f"{p}.mlp.shared_expert_gate.weight"] = linear(1, H)
        else:
            state[f"{p}.mlp.gate_proj.weight"] = linear(config.intermediate_size, H)
            state[f"{p}.mlp.up_proj.weight"] = linear(config.intermediate_size, H)
            state[f"{p}.mlp.down_proj.weight"] = linear(H, config.intermediate_size)
    state["model.norm.weight"] = norm(H, config.gemma_norm or config.gemma_final_norm)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] if config.tie_word_embeddings else linear(V, H)
    return {k: v.to(dtype) for k, v in state.items()}
