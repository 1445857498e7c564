"""Registers `nemotron_h`: its embedded tiny config, weight loading and random weights."""

from __future__ import annotations

import math

import torch

from layer_boundary.plugin import TensorSource, loads_weights

#: 11 layers whose edges cover mixer->mixer (Mamba and attention, both orders), mixer->FFN,
#: FFN->mixer, FFN->FFN and a terminal mixer; a two-stage pipeline cuts between two Mamba
#: layers (5 | 6). Prompts of ~7 tokens span two 4-token scan chunks.
PRESET = {
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "hybrid_override_pattern": "M-ME*MM*E-M",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 16,
    "mamba_head_dim": 8,
    "n_groups": 8,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 4,
    "use_conv_bias": True,
    "time_step_min": 0.001,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 64,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "max_position_embeddings": 512,
}

def parse(raw):
    from .nemotron_h import NemotronHConfig

    return NemotronHConfig.from_hf(raw)


def _prefix(src: TensorSource, model) -> str:
    """`model` (a state dict of the HF module) or `backbone` (checkpoints as NVIDIA ships them
    and as save_pretrained() writes them)."""
    probe = f"layers.{model.layers[0].layer_id}.norm.weight" if len(model.layers) else "norm_f.weight"
    return "backbone" if src.get(f"model.{probe}") is None and src.get(f"backbone.{probe}") is not None else "model"


def _experts(src: TensorSource, m: str, name: str, count: int) -> torch.Tensor:
    """Stacked expert weights [E, out, in]: fused (`experts.up_proj`) or one tensor per expert."""
    fused = src.get(f"{m}.experts.{name}")
    if fused is not None:
        return fused
    return torch.stack([src.require(f"{m}.experts.{e}.{name}.weight") for e in range(count)])


@loads_weights
@torch.no_grad()
def load_weights(model, src: TensorSource) -> None:
    """Copy this pipeline stage's weights from `src` (Hugging Face names), sharded per rank."""
    cfg = model.config
    ref = next(model.parameters())
    top = _prefix(src, model)

    def get(name):
        return src.require(name).to(dtype=ref.dtype, device=ref.device)

    if model.embeddings is not None:
        model.embeddings.weight.copy_(get(f"{top}.embeddings.weight"))
    if model.norm_f is not None:
        model.norm_f.weight.copy_(get(f"{top}.norm_f.weight"))
        tied = cfg.tie_word_embeddings and src.get("lm_head.weight") is None
        model.lm_head.weight.copy_(get(f"{top}.embeddings.weight" if tied else "lm_head.weight"))
    for layer in model.layers:
        p = f"{top}.layers.{layer.layer_id}"
        m = f"{p}.mixer"
        layer.norm.weight.copy_(get(f"{p}.norm.weight"))
        if layer.kind == "M":
            layer.mixer.load_full(
                in_proj=get(f"{m}.in_proj.weight"),
                conv_weight=get(f"{m}.conv1d.weight"),
                conv_bias=get(f"{m}.conv1d.bias") if cfg.use_conv_bias else None,
                dt_bias=get(f"{m}.dt_bias"),
                A_log=get(f"{m}.A_log"),
                D=get(f"{m}.D"),
                norm=get(f"{m}.norm.weight"),
                out_proj=get(f"{m}.out_proj.weight"),
            )
        elif layer.kind == "*":
            attn = layer.mixer
            attn.load_qkv(get(f"{m}.q_proj.weight"), get(f"{m}.k_proj.weight"), get(f"{m}.v_proj.weight"))
            attn.o_proj.load_full(get(f"{m}.o_proj.weight"))
        elif layer.kind == "-":
            layer.mixer.load_full(get(f"{m}.up_proj.weight"), get(f"{m}.down_proj.weight"))
        else:
            latent = cfg.moe_latent_size is not None
            layer.mixer.load_full(
                router=get(f"{m}.gate.weight"),
                score_bias=get(f"{m}.gate.e_score_correction_bias"),
                up=_experts(src, m, "up_proj", cfg.n_routed_experts).to(dtype=ref.dtype, device=ref.device),
                down=_experts(src, m, "down_proj", cfg.n_routed_experts).to(dtype=ref.dtype, device=ref.device),
                shared_up=get(f"{m}.shared_experts.up_proj.weight"),
                shared_down=get(f"{m}.shared_experts.down_proj.weight"),
                latent_in=get(f"{m}.fc1_latent_proj.weight") if latent else None,
                latent_out=get(f"{m}.fc2_latent_proj.weight") if latent else None,
            )


def random_weights(config, dtype: torch.dtype, seed: int) -> dict:
    """A seeded random state dict with Hugging Face names.

    Linear weights have std 1/sqrt(fan_in), norms 1 + 0.1 N(0, 1); the Mamba parameters follow
    Hugging Face's initialisation (A in [1, 16], dt between 0.001 and 0.1 through softplus), so
    the scan decays at realistic rates and every sum shows up in the logits.
    """
    gen = torch.Generator().manual_seed(seed)
    H, V = config.hidden_size, config.vocab_size

    def linear(out_f, in_f, *lead):
        return torch.randn(*lead, out_f, in_f, generator=gen) / in_f**0.5

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    state = {"model.embeddings.weight": torch.randn(V, H, generator=gen)}
    heads, I = config.mamba_num_heads, config.mamba_num_heads * config.mamba_head_dim
    GN = config.n_groups * config.ssm_state_size
    for i, kind in enumerate(config.pattern):
        p = f"model.layers.{i}"
        m = f"{p}.mixer"
        state[f"{p}.norm.weight"] = norm(H)
        if kind == "M":
            conv_dim = I + 2 * GN
            state[f"{m}.in_proj.weight"] = linear(2 * I + 2 * GN + heads, H)
            state[f"{m}.conv1d.weight"] = torch.randn(conv_dim, 1, config.conv_kernel, generator=gen) / config.conv_kernel**0.5
            if config.use_conv_bias:
                state[f"{m}.conv1d.bias"] = 0.1 * torch.randn(conv_dim, generator=gen)
            log_dt = torch.rand(heads, generator=gen) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)
            dt = torch.exp(log_dt)
            state[f"{m}.dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
            state[f"{m}.A_log"] = torch.log(1.0 + 15.0 * torch.rand(heads, generator=gen))
            state[f"{m}.D"] = norm(heads)
            state[f"{m}.norm.weight"] = norm(I)
            state[f"{m}.out_proj.weight"] = linear(H, I)
        elif kind == "*":
            D = config.head_dim
            state[f"{m}.q_proj.weight"] = linear(config.num_heads * D, H)
            state[f"{m}.k_proj.weight"] = linear(config.num_kv_heads * D, H)
            state[f"{m}.v_proj.weight"] = linear(config.num_kv_heads * D, H)
            state[f"{m}.o_proj.weight"] = linear(H, config.num_heads * D)
        elif kind == "-":
            state[f"{m}.up_proj.weight"] = linear(config.intermediate_size, H)
            state[f"{m}.down_proj.weight"] = linear(H, config.intermediate_size)
        else:
            E, W = config.n_routed_experts, config.moe_intermediate_size
            inner = config.moe_latent_size or H
            state[f"{m}.gate.weight"] = linear(E, H)
            state[f"{m}.gate.e_score_correction_bias"] = 0.1 * torch.randn(E, generator=gen)
            state[f"{m}.experts.up_proj"] = linear(W, inner, E)
            state[f"{m}.experts.down_proj"] = linear(inner, W, E)
            S = config.shared_intermediate_size
            state[f"{m}.shared_experts.up_proj.weight"] = linear(S, H)
            state[f"{m}.shared_experts.down_proj.weight"] = linear(H, S)
            if config.moe_latent_size:
                state[f"{m}.fc1_latent_proj.weight"] = linear(inner, H)
                state[f"{m}.fc2_latent_proj.weight"] = linear(H, inner)
    state["model.norm_f.weight"] = norm(H)
    state["lm_head.weight"] = state["model.embeddings.weight"] if config.tie_word_embeddings else linear(V, H)
    return {k: v.to(dtype) for k, v in state.items()}
