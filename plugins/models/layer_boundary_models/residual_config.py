"""The configuration of the families whose residual is not pre-norm RMSNorm, parsed from a
Hugging Face config: OLMo-2 (post-norm), GPT-NeoX (LayerNorm with biases, parallel or
sequential residual, partial rotary) and Cohere (one LayerNorm feeding both branches).

Every Hugging Face field these models read is taken here; a value the reference models do not
implement is a `ConfigError` naming the field, raised before any rank starts.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import attrs

from .config import ConfigError, FamilyConfig, check_dense_split
from .mlp import activation

__all__ = ["ResidualConfig", "POST_NORM", "PARALLEL", "SEQUENTIAL"]

#: h = h + norm(f(h)) around each sublayer (OLMo-2)
POST_NORM = "post_norm"
#: h = h + attn(n1(h)) + mlp(n2(h)) (GPT-NeoX's use_parallel_residual, Cohere with n1 = n2)
PARALLEL = "parallel"
#: h = h + attn(n1(h)); h = h + mlp(n2(h)) (GPT-NeoX without the parallel residual)
SEQUENTIAL = "sequential"

_ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM", "cohere": "CohereForCausalLM"}
#: each config class's default rope_theta (transformers' `default_theta`)
_DEFAULT_THETA = {"olmo2": 10000.0, "gpt_neox": 10000.0, "cohere": 500000.0}


@attrs.frozen(kw_only=True)
class ResidualConfig(FamilyConfig):
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    #: the leading channels of each head the rotation turns (GPT-NeoX's partial rotary)
    rotary_dim: int
    #: "half" (the two halves of the rotated channels pair up) or "interleaved" (Cohere: neighbours pair up)
    rotary_style: str
    hidden_act: str
    residual: str
    #: q/k norms: None, "projection" (OLMo-2: one RMSNorm over the whole q and k projections) or
    #: "head" (Cohere's use_qk_norm: a LayerNorm per head, its own weights per head)
    qk_norm: Optional[str]
    attention_bias: bool
    #: GPT-NeoX: biases on both MLP projections, an ungated MLP
    mlp_bias: bool
    gated_mlp: bool
    #: Cohere: the logits are multiplied by it
    logit_scale: Optional[float] = None

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "ResidualConfig":
        cfg = dict(raw)
        model_type = cfg.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ConfigError(f"model_type {model_type!r} is not one of {', '.join(_ARCHITECTURES)}")
        hidden = _positive(cfg, "hidden_size")
        heads = _positive(cfg, "num_attention_heads")
        if hidden % heads:
            raise ConfigError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        neox = model_type == "gpt_neox"
        head_dim = hidden // heads if neox else int(cfg.get("head_dim") or hidden // heads)
        if neox and cfg.get("head_dim") not in (None, head_dim):
            raise ConfigError(f"head_dim={cfg['head_dim']}: GPT-NeoX's head size is hidden_size / num_attention_heads = {head_dim}")
        kv_heads = heads if neox else int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
        theta, factor = _rope(cfg, model_type)
        rotary_dim = int(head_dim * factor) if neox else head_dim
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ConfigError(
                f"partial_rotary_factor={factor} turns {rotary_dim} of the {head_dim} channels of a head; the rotation needs an "
                "even, positive number"
            )
        act = cfg.get("hidden_act") or ("gelu" if neox else "silu")
        try:
            activation(act)
        except ValueError:
            raise ConfigError(f"hidden_act={act!r} is not supported; use silu, gelu, gelu_pytorch_tanh or relu2") from None
        if model_type == "olmo2":
            residual, qk_norm = POST_NORM, "projection"
        elif neox:
            residual, qk_norm = (PARALLEL if cfg.get("use_parallel_residual", True) else SEQUENTIAL), None
        else:
            residual, qk_norm = PARALLEL, "head" if cfg.get("use_qk_norm") else None
        eps_key = "rms_norm_eps" if model_type == "olmo2" else "layer_norm_eps"
        eps = cfg.get(eps_key)
        scale = cfg.get("logit_scale", 0.0625) if model_type == "cohere" else None
        if model_type == "cohere" and not isinstance(scale, (int, float)):
            raise ConfigError(f"logit_scale={scale!r}: Cohere multiplies its logits by it; give a number")
        return cls(
            model_type=model_type,
            architecture=(cfg.get("architectures") or [_ARCHITECTURES[model_type]])[0],
            vocab_size=_positive(cfg, "vocab_size"),
            hidden_size=hidden,
            num_layers=_positive(cfg, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_positive(cfg, "intermediate_size"),
            norm_eps=float(1e-5 if eps is None else eps),
            rope_theta=theta,
            rotary_dim=rotary_dim,
            rotary_style="interleaved" if model_type == "cohere" else "half",
            hidden_act=act,
            residual=residual,
            qk_norm=qk_norm,
            attention_bias=bool(cfg.get("attention_bias", neox)),
            mlp_bias=neox,
            gated_mlp=not neox,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "cohere")),
            logit_scale=None if scale is None else float(scale),
            hf=cfg,
        )

    def check_topology(self, topology) -> None:
        """Raise `ConfigError` naming the fix when the topology cannot split this model."""
        if topology.attn_cp > 1:
            raise ConfigError(f"{self.model_type} runs without context parallel attention; use --attn-cp 1")
        check_dense_split(self, topology)


def _positive(cfg: Mapping, key: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise ConfigError(f"the config has no {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive integer")
    return value


def _rope(cfg: Mapping, model_type: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from `rope_parameters` or the older top-level keys
    (GPT-NeoX's `rotary_emb_base` and `rotary_pct`); only the default rope is implemented."""
    if cfg.get("rope_scaling"):
        raise ConfigError(f"rope_scaling={cfg['rope_scaling']!r} is not supported; the reference models use the default rope")
    rope = cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ConfigError(f"rope_parameters.rope_type={kind!r} is not supported; the reference models use the default rope")
    theta = rope.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", _DEFAULT_THETA[model_type])))
    factor = rope.get("partial_rotary_factor", cfg.get("rotary_pct", 0.25)) if model_type == "gpt_neox" else 1.0
    if not 0.0 < float(factor) <= 1.0:
        raise ConfigError(f"partial_rotary_factor={factor} must be in (0, 1]")
    return float(theta), float(factor)
