"""The DeepSeek-V4 configuration the reference model reads, parsed from a Hugging Face config.

Only what the reference model implements is accepted: sliding-window attention layers and
learned-router MoE layers. Compressed attention (CSA / HCA) and hash routing are rejected with
a message instead of silently computing something else.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from .config import NO_PIPELINE, ConfigError, FamilyConfig

__all__ = ["DeepseekV4Config"]

_DEFAULT_PARTIAL_ROTARY = 64 / 512  # HF's default: qk_rope_head_dim / head_dim of V4-Flash


@attrs.frozen(kw_only=True)
class DeepseekV4Config(FamilyConfig):
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    rope_theta: float
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    hidden_act: str
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "DeepseekV4Config":
        cfg = cls.of_type(raw, "deepseek_v4")
        layers = int(cfg.get("num_hidden_layers", 43))
        attn_types = list(cfg.get("layer_types") or [])
        if len(attn_types) != layers or any(t != "sliding_attention" for t in attn_types):
            raise ConfigError(
                "the deepseek_v4 reference model implements sliding-window attention only (no compressed CSA/HCA layers); "
                f"set layer_types to {layers} x \"sliding_attention\""
            )
        mlp_types = list(cfg.get("mlp_layer_types") or [])
        if len(mlp_types) != layers or any(t != "moe" for t in mlp_types):
            raise ConfigError(f"the deepseek_v4 reference model routes with a learned gate only (no hash_moe); set mlp_layer_types to {layers} x \"moe\"")
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ConfigError(f"{key}=true is not supported by the deepseek_v4 reference model")
        head_dim = int(cfg.get("head_dim", 512))
        theta, partial = _main_rope(cfg, head_dim)
        rope_dim = int(head_dim * partial)
        if rope_dim % 2 or not 2 <= rope_dim <= head_dim:
            raise ConfigError(f"the rotary width head_dim * partial_rotary_factor = {rope_dim} must be even, between 2 and head_dim")
        if int(cfg.get("hc_mult", 4)) < 1:
            raise ConfigError("hc_mult must be at least 1")
        return cls(
            model_type="deepseek_v4",
            architecture=(cfg.get("architectures") or ["DeepseekV4ForCausalLM"])[0],
            vocab_size=int(cfg.get("vocab_size", 129280)),
            hidden_size=int(cfg.get("hidden_size", 4096)),
            num_layers=layers,
            num_heads=int(cfg.get("num_attention_heads", 64)),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            rope_theta=theta,
            q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
            o_groups=int(cfg.get("o_groups", 8)),
            o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
            sliding_window=int(cfg.get("sliding_window", 128)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            num_experts=int(cfg.get("n_routed_experts", 256)),
            top_k=int(cfg.get("num_experts_per_tok", 6)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 2048)),
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
            hc_mult=int(cfg.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hf=cfg,
        )

    def check_topology(self, topology) -> None:
        """Raise `ConfigError` naming the fix when the topology cannot split this model."""
        if topology.pp > 1:
            raise ConfigError(NO_PIPELINE.format(model="deepseek_v4"))
        attn_tp = topology.attn_tp
        if self.num_heads % attn_tp:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not divisible by attention TP {attn_tp}")
        if self.num_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not divisible by o_groups={self.o_groups}")
        local, per_group = self.num_heads // attn_tp, self.num_heads // self.o_groups
        if local % per_group and per_group % local:
            raise ConfigError(
                f"each attention-TP rank holds {local} heads and each output group {per_group}; one must divide the other "
                "(choose attention TP so ranks hold whole groups or equal parts of one)"
            )
        if self.num_experts % topology.moe_ep:
            raise ConfigError(f"n_routed_experts={self.num_experts} is not divisible by moe_ep={topology.moe_ep}")
        if self.moe_intermediate_size % topology.moe_tp:
            raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size} is not divisible by moe_tp={topology.moe_tp}")
        if self.moe_intermediate_size % topology.tp:
            raise ConfigError(f"the shared expert's moe_intermediate_size={self.moe_intermediate_size} is not divisible by TP {topology.tp}")


def _main_rope(cfg: Mapping[str, Any], head_dim: int) -> tuple[float, float]:
    """(theta, partial rotary factor) of the sliding layers' "main" RoPE (always default type)."""
    partial = cfg.get("partial_rotary_factor")
    if partial is None and cfg.get("qk_rope_head_dim") is not None:
        partial = int(cfg["qk_rope_head_dim"]) / head_dim
    theta = float(cfg.get("rope_theta", 10000.0))
    main = (cfg.get("rope_parameters") or {}).get("main")
    if isinstance(main, dict):
        if main.get("rope_type", "default") != "default":
            raise ConfigError(f"main rope_type {main.get('rope_type')!r} is not supported; sliding layers use default RoPE")
        theta = float(main.get("rope_theta", theta))
        partial = main.get("partial_rotary_factor", partial)
    return theta, float(partial if partial is not None else _DEFAULT_PARTIAL_ROTARY)
