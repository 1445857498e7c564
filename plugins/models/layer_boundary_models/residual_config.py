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
        model_type = raw.get("model_type") if isinstance(raw, Mapping) else None
        if model_type not in _ARCHITECTURES:
            raise ConfigError(f"model_type {model_type!r} is not one of {', '.join(_ARCHITECTURES)}")
        f = cls.fields(raw, model_type)
        hidden = f.int("hidden_size", min=1)
        heads = f.int("num_attention_heads", min=1)
        if hidden % heads:
            raise ConfigError(f"{model_type} config: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        neox = model_type == "gpt_neox"
        head_dim = hidden // heads if neox else f.int("head_dim", hidden // heads, min=1)
        if neox and f.get("head_dim") not in (None, head_dim):
            raise ConfigError(f"{model_type} config: head_dim={f.get('head_dim')}: GPT-NeoX's head size is hidden_size / "
                              f"num_attention_heads = {head_dim}")
        kv_heads = heads if neox else f.int("num_key_value_heads", heads, min=1)
        if heads % kv_heads:
            raise ConfigError(f"{model_type} config: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
        theta, factor = _rope(f, model_type)
        rotary_dim = int(head_dim * factor) if neox else head_dim
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ConfigError(
                f"{model_type} config: partial_rotary_factor={factor} turns {rotary_dim} of the {head_dim} channels of a head; the "
                "rotation needs an even, positive number"
            )
        act = f.str("hidden_act", "gelu" if neox else "silu")
        try:
            activation(act)
        except ValueError:
            raise ConfigError(f"{model_type} config: hidden_act={act!r} is not supported; use silu, gelu, gelu_pytorch_tanh or relu2") from None
        if model_type == "olmo2":
            residual, qk_norm = POST_NORM, "projection"
        elif neox:
            residual, qk_norm = (PARALLEL if f.bool("use_parallel_residual", True) else SEQUENTIAL), None
        else:
            residual, qk_norm = PARALLEL, "head" if f.bool("use_qk_norm", False) else None
        eps = f.float("rms_norm_eps" if model_type == "olmo2" else "layer_norm_eps", 1e-5, positive=True)
        if model_type == "cohere" and "logit_scale" in raw and raw["logit_scale"] is None:
            raise f.fail("logit_scale", "a number (Cohere multiplies its logits by it)")
        scale = f.float("logit_scale", 0.0625) if model_type == "cohere" else None
        return cls(
            model_type=model_type,
            architecture=(f.list("architectures", (_ARCHITECTURES[model_type],), of=str) or (_ARCHITECTURES[model_type],))[0],
            vocab_size=f.int("vocab_size", min=1),
            hidden_size=hidden,
            num_layers=f.int("num_hidden_layers", min=1),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=f.int("intermediate_size", min=1),
            norm_eps=eps,
            rope_theta=theta,
            rotary_dim=rotary_dim,
            rotary_style="interleaved" if model_type == "cohere" else "half",
            hidden_act=act,
            residual=residual,
            qk_norm=qk_norm,
            attention_bias=f.bool("attention_bias", neox),
            mlp_bias=neox,
            gated_mlp=not neox,
            tie_word_embeddings=f.bool("tie_word_embeddings", model_type == "cohere"),
            logit_scale=scale,
            hf=dict(raw),
        )

    def check_topology(self, topology) -> None:
        """Raise `ConfigError` naming the fix when the topology cannot split this model."""
        if topology.attn_cp > 1:
            raise ConfigError(f"{self.model_type} runs without context parallel attention; use --attn-cp 1")
        check_dense_split(self, topology)


def _rope(f, model_type: str) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from `rope_parameters` or the older top-level keys
    (GPT-NeoX's `rotary_emb_base` and `rotary_pct`); only the default rope is implemented."""
    if f.has("rope_scaling"):
        raise ConfigError(f"{model_type} config: rope_scaling={f.get('rope_scaling')!r} is not supported; the reference models use "
                          "the default rope")
    rope = f.sub("rope_parameters")
    kind = rope.str("rope_type", "default")
    if kind != "default":
        raise ConfigError(f"{model_type} config: rope_parameters.rope_type={kind!r} is not supported; the reference models use "
                          "the default rope")
    theta = rope.float("rope_theta", None, positive=True)
    if theta is None:
        theta = f.float(f.first(("rope_theta", "rotary_emb_base")) or "rope_theta", _DEFAULT_THETA[model_type], positive=True)
    factor = 1.0
    if model_type == "gpt_neox":
        factor = rope.float("partial_rotary_factor", None)
        if factor is None:
            factor = f.float("rotary_pct", 0.25)
    if not 0.0 < factor <= 1.0:
        raise ConfigError(f"{model_type} config: partial_rotary_factor={factor} must be in (0, 1]")
    return theta, factor
