"""The configuration of the Gemma 2 and Gemma 3 (text) reference models, parsed from a Hugging
Face config with the defaults transformers gives a missing key.

Both are sandwich-norm decoders: every sublayer has a norm before it and one on its complete
output, before the residual add. Gemma 2 soft-caps attention scores and the final logits;
Gemma 3 adds (1 + w) q/k norms per head and a rotary base of its own for the sliding-window
layers. What the reference model does not implement is refused here, naming the field.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import attrs

from layer_boundary.plugin import ConfigFields

from .config import ConfigError, DenseConfig, check_dense_split

__all__ = ["GemmaSandwichConfig", "RopeSpec", "LAYER_TYPES"]

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)

#: what transformers 5.24 uses for a key the config leaves out (Gemma2Config, Gemma3TextConfig)
_DEFAULTS = {
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0, "tie_word_embeddings": True, "max_position_embeddings": 8192,
    },
    "gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "tie_word_embeddings": True, "max_position_embeddings": 131072,
    },
}
_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
#: Gemma 3's default rotary bases per layer type (Gemma3TextConfig.default_theta)
_GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
#: rope types the reference rotary implements
_ROPE_TYPES = ("default", "linear")


@attrs.frozen
class RopeSpec:
    """A rotary embedding: its base and linear scaling factor (1: none)."""

    theta: float
    factor: float = 1.0


@attrs.frozen(kw_only=True)
class GemmaSandwichConfig(DenseConfig):
    #: the scores are scaled by query_pre_attn_scalar**-0.5 (not head_dim**-0.5)
    query_pre_attn_scalar: float
    sliding_window: Optional[int]
    #: per layer: "sliding_attention" or "full_attention"
    layer_types: tuple
    attn_logit_softcapping: Optional[float]
    final_logit_softcapping: Optional[float]
    #: (1 + w) RMSNorms of each query and key head (Gemma 3)
    qk_norm: bool
    #: the rotary embedding of each layer type
    rope: Mapping[str, RopeSpec]
    embed_scale: float

    @property
    def rope_theta(self) -> float:
        """The full-attention layers' base (what a single-rope consumer reads)."""
        return self.rope[FULL].theta

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "GemmaSandwichConfig":
        model_type = raw.get("model_type")
        if model_type not in _DEFAULTS:
            raise ConfigError(f"model_type {model_type!r} is not a Gemma 2/3 text model; use gemma2 or gemma3_text")
        cfg = {**_DEFAULTS[model_type], **{k: v for k, v in raw.items() if v is not None or k in _DEFAULTS[model_type]}}
        f = cls.fields(cfg, model_type)
        for key in ("attention_bias", "use_bidirectional_attention"):
            if f.bool(key, False):
                raise ConfigError(f"{key}=true is not supported by the {model_type} reference model; set it to false")
        layers = f.int("num_hidden_layers", min=1)
        layer_types = _layer_types(f, model_type, layers)
        window = None
        if SLIDING in layer_types:
            if cfg.get("sliding_window") is None:
                raise ConfigError(f"{model_type} config: sliding_window=None: the sliding_attention layers need a positive integer window")
            window = f.int("sliding_window", min=1)
        if model_type == "gemma3_text" and cfg.get("attn_logit_softcapping") is not None:
            raise ConfigError(
                "gemma3_text config: attn_logit_softcapping is set, but Gemma 3's attention (transformers 5.24) never applies it; set it to null"
            )
        if f.float("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"partial_rotary_factor={cfg['partial_rotary_factor']}: the {model_type} reference model rotates whole heads")
        rope = _gemma3_rope(f) if model_type == "gemma3_text" else _gemma2_rope(f)
        hidden = f.int("hidden_size", min=1)
        heads = f.int("num_attention_heads", min=1)
        act = f.str("hidden_activation", None) or "gelu_pytorch_tanh"  # HF's Gemma 2/3 MLPs read hidden_activation only
        if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu", "silu"):
            raise ConfigError(f"hidden_activation={act!r} is not supported; the reference MLP runs gelu_pytorch_tanh, gelu or silu")
        softcaps = {}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = f.float(key, None)
            if value is not None and not value > 0:
                raise ConfigError(f"{key}={value!r} must be positive, or null for no soft cap")
            softcaps[key] = value
        return cls(
            model_type=model_type,
            architecture=(f.list("architectures", (), of=str) or (_ARCHITECTURES[model_type],))[0],
            vocab_size=f.int("vocab_size", min=1),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=f.int("num_key_value_heads", min=1),
            head_dim=f.int("head_dim", min=1),
            intermediate_size=f.int("intermediate_size", min=1),
            rms_norm_eps=f.float("rms_norm_eps", positive=True),
            hidden_act=act,
            query_pre_attn_scalar=f.float("query_pre_attn_scalar", positive=True),
            sliding_window=window,
            layer_types=layer_types,
            attn_logit_softcapping=softcaps["attn_logit_softcapping"],
            final_logit_softcapping=softcaps["final_logit_softcapping"],
            qk_norm=model_type == "gemma3_text",
            rope=rope,
            tie_word_embeddings=f.bool("tie_word_embeddings"),
            embed_scale=hidden**0.5,
            hf=dict(raw),
        )

    def check_topology(self, topology) -> None:
        """Raise `ConfigError` naming the fix when the topology cannot split this model."""
        if topology.attn_cp > 1:
            raise ConfigError(f"{self.model_type} runs without context parallelism (its attention has a sliding window); use --attn-cp 1")
        check_dense_split(self, topology)


def _layer_types(f, model_type: str, layers: int) -> tuple:
    """`layer_types`, or HF's default pattern: Gemma 2 alternates sliding and full layers, Gemma 3
    has a full layer every `sliding_window_pattern` (6) layers."""
    types = f.list("layer_types", None, of=str)
    if types is None:
        period = 2 if model_type == "gemma2" else f.int("sliding_window_pattern", 6, min=1)
        return tuple(SLIDING if (i + 1) % period else FULL for i in range(layers))
    if len(types) != layers:
        raise ConfigError(f"layer_types has {len(types)} entries for num_hidden_layers={layers}; give one per layer")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types has {unknown}; the {model_type} reference model runs sliding_attention and full_attention layers")
    return types


def _rope_spec(params: Mapping[str, Any], field: str, family: str) -> RopeSpec:
    p = ConfigFields(params, family, error=ConfigError, prefix=f"{field}.")
    rope_type = p.str("rope_type", None) or p.str("type", "default")
    if rope_type not in _ROPE_TYPES:
        raise ConfigError(f"{field}: rope_type {rope_type!r} is not supported; the reference models run {' and '.join(_ROPE_TYPES)} RoPE")
    if p.float("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{field}: partial_rotary_factor={params['partial_rotary_factor']}; the reference model rotates whole heads")
    factor = p.float("factor", None) if rope_type == "linear" else 1.0
    if rope_type == "linear" and not (factor or 0) > 0:
        raise ConfigError(f"{field}: a linear rope needs a positive factor, got {params.get('factor')!r}")
    return RopeSpec(theta=p.float("rope_theta", positive=True), factor=factor)


def _gemma2_rope(f) -> dict:
    """One rope for every layer: `rope_scaling` (older configs) or `rope_parameters`."""
    key = f.first(("rope_scaling", "rope_parameters")) or "rope_parameters"
    params = dict(f.dict(key, {}))
    if any(k in LAYER_TYPES for k in params):
        raise ConfigError("rope_parameters: gemma2 takes one rope for every layer, not one per layer type")
    params.setdefault("rope_theta", f.float("rope_theta", 10000.0, positive=True))
    spec = _rope_spec(params, key, f.family)
    return {SLIDING: spec, FULL: spec}


def _gemma3_rope(f) -> dict:
    """A rope per layer type: `rope_parameters` nested by layer type, filled in as
    Gemma3TextConfig does (`rope_scaling` updates the full-attention rope; `rope_theta` and
    `rope_local_base_freq` are the bases a nested entry leaves out)."""
    given = f.dict("rope_parameters", None)
    if given and not set(given) <= set(LAYER_TYPES):
        raise ConfigError(
            "rope_parameters: gemma3_text takes one entry per layer type ({\"full_attention\": {...}, \"sliding_attention\": {...}}); "
            "transformers ignores a flat one"
        )
    given_fields = f.sub("rope_parameters")
    nested = {kind: dict(given_fields.dict(kind, None) or {"rope_type": "default"}) for kind in LAYER_TYPES}
    nested[FULL].update(f.dict("rope_scaling", {}))
    nested[FULL].setdefault("rope_theta", f.float("rope_theta", _GEMMA3_THETA[FULL], positive=True))
    nested[SLIDING].setdefault("rope_theta", f.float("rope_local_base_freq", _GEMMA3_THETA[SLIDING], positive=True))
    return {kind: _rope_spec(params, f"rope_parameters[{kind!r}]", f.family) for kind, params in nested.items()}
