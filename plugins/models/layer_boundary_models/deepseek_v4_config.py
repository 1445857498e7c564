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
        f = cls.fields(raw, "deepseek_v4")
        layers = f.int("num_hidden_layers", 43, min=1)
        attn_types = f.list("layer_types", (), of=str)
        if len(attn_types) != layers or any(t != "sliding_attention" for t in attn_types):
            raise ConfigError(
                "the deepseek_v4 reference model implements sliding-window attention only (no compressed CSA/HCA layers); "
                f"set layer_types to {layers} x \"sliding_attention\""
            )
        mlp_types = f.list("mlp_layer_types", (), of=str)
        if len(mlp_types) != layers or any(t != "moe" for t in mlp_types):
            raise ConfigError(f"the deepseek_v4 reference model routes with a learned gate only (no hash_moe); set mlp_layer_types to {layers} x \"moe\"")
        for key in ("attention_bias", "mlp_bias"):
            if f.bool(key, False):
                raise ConfigError(f"{key}=true is not supported by the deepseek_v4 reference model")
        head_dim = f.int("head_dim", 512, min=1)
        theta, partial = _main_rope(f, head_dim)
        rope_dim = int(head_dim * partial)
        if rope_dim % 2 or not 2 <= rope_dim <= head_dim:
            raise ConfigError(f"the rotary width head_dim * partial_rotary_factor = {rope_dim} must be even, between 2 and head_dim")
        return cls(
            model_type="deepseek_v4",
            architecture=(f.list("architectures", (), of=str) or ("DeepseekV4ForCausalLM",))[0],
            vocab_size=f.int("vocab_size", 129280, min=1),
            hidden_size=f.int("hidden_size", 4096, min=1),
            num_layers=layers,
            num_heads=f.int("num_attention_heads", 64, min=1),
            head_dim=head_dim,
            rope_head_dim=rope_dim,
            rope_theta=theta,
            q_lora_rank=f.int("q_lora_rank", 1024, min=1),
            o_groups=f.int("o_groups", 8, min=1),
            o_lora_rank=f.int("o_lora_rank", 1024, min=1),
            sliding_window=f.int("sliding_window", 128, min=1),
            rms_norm_eps=f.float("rms_norm_eps", 1e-6, positive=True),
            num_experts=f.int("n_routed_experts", 256, min=1),
            top_k=f.int("num_experts_per_tok", 6, min=1),
            moe_intermediate_size=f.int("moe_intermediate_size", 2048, min=1),
            scoring_func=f.str("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=f.float("routed_scaling_factor", 1.5),
            swiglu_limit=f.float("swiglu_limit", 10.0),
            hidden_act=f.str("hidden_act", "silu"),
            hc_mult=f.int("hc_mult", 4, min=1),
            hc_sinkhorn_iters=f.int("hc_sinkhorn_iters", 20, min=1),
            hc_eps=f.float("hc_eps", 1e-6),
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            hf=dict(raw),
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


def _main_rope(f, head_dim: int) -> tuple[float, float]:
    """(theta, partial rotary factor) of the sliding layers' "main" RoPE (always default type)."""
    partial = f.float("partial_rotary_factor", None, positive=True)
    if partial is None and f.has("qk_rope_head_dim"):
        partial = f.int("qk_rope_head_dim", min=1) / head_dim
    theta = f.float("rope_theta", 10000.0, positive=True)
    main = f.sub("rope_parameters").raw.get("main")
    if isinstance(main, Mapping):
        m = f.sub("rope_parameters").sub("main")
        rope_type = m.str("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"main rope_type {rope_type!r} is not supported; sliding layers use default RoPE")
        theta = m.float("rope_theta", theta, positive=True)
        partial = m.float("partial_rotary_factor", partial, positive=True)
    return theta, float(partial if partial is not None else _DEFAULT_PARTIAL_ROTARY)
