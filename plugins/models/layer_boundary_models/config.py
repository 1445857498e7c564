"""The decoder configuration the reference models read, parsed from a Hugging Face config.

Only what the reference models implement is accepted; anything else (sliding windows, biases,
other rope types) is rejected with a message instead of silently computing something else.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import attrs

from layer_boundary.plugin import ConfigError as PluginConfigError
from layer_boundary.plugin import ConfigFields

__all__ = ["FamilyConfig", "DenseConfig", "DecoderConfig", "check_dense_split", "ConfigError", "FINAL_NORM_KEY", "NO_PIPELINE", "fp8_option"]

#: a reference-model option (not a Hugging Face key): "gemma" gives qwen3_moe a (1 + w) final norm
FINAL_NORM_KEY = "layer_boundary_final_norm"


class ConfigError(PluginConfigError):
    """A model configuration the reference models cannot run, or that a topology cannot split."""


#: the refusal of a model without pipeline stages
NO_PIPELINE = "{model} runs without pipeline stages; use --pp 1 (qwen3, qwen3_moe, gemma, gemma2, gemma3, nemotron_h, olmo2, gpt_neox and cohere take --pp)"


@attrs.frozen(kw_only=True)
class FamilyConfig:
    """The fields every reference family's config has (the Hugging Face dict `hf` and the sizes
    `layer-boundary run` reports), and the check that a raw config is of the family's model_type."""

    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    tie_word_embeddings: bool
    hf: Mapping[str, Any] = attrs.field(factory=dict, repr=False)

    @staticmethod
    def fields(raw: Mapping[str, Any], model_type: str, family: Optional[str] = None) -> ConfigFields:
        """`raw` read field by field (`ConfigFields`: each missing or mistyped field one line
        naming `family`, default the model_type), refused unless its model_type is `model_type`."""
        fields = ConfigFields(raw, family or model_type, error=ConfigError)
        if raw.get("model_type") != model_type:
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not {model_type}")
        return fields

    @staticmethod
    def of_type(raw: Mapping[str, Any], model_type: str) -> dict:
        """A copy of `raw`, refused unless its model_type is `model_type`."""
        cfg = dict(raw)
        if cfg.get("model_type") != model_type:
            raise ConfigError(f"model_type {cfg.get('model_type')!r} is not {model_type}")
        return cfg


@attrs.frozen(kw_only=True)
class DenseConfig(FamilyConfig):
    """The fields of a decoder of GQA attention and an MLP of one width (what `check_dense_split`
    reads)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str


@attrs.frozen(kw_only=True)
class DecoderConfig(DenseConfig):
    rope_theta: float
    qk_norm: bool
    gemma_norm: bool
    embed_scale: Optional[float]
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: frozenset = frozenset()
    shared_expert_intermediate_size: int = 0
    #: FP8 reads at attention and dense-FFN inputs: None, "fp8_dynamic" or "fp8_static"
    #: (config key "layer_boundary_fp8"; not a Hugging Face field)
    fp8_reads: Optional[str] = None
    #: qwen3_moe option (config key `layer_boundary_final_norm: "gemma"`): a (1 + w) final norm, so a
    #: fused terminal MoE finalize into a GemmaRMSNorm can run; no Hugging Face model has it
    gemma_final_norm: bool = False

    def is_sparse(self, layer: int) -> bool:
        return 0 <= layer < self.num_layers and layer in self.sparse_layers

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "DecoderConfig":
        model_type = raw.get("model_type") if isinstance(raw, Mapping) else None
        if model_type not in ("qwen3", "qwen3_moe", "gemma"):
            raise ConfigError(f"model_type {model_type!r} is not a reference model; use qwen3, qwen3_moe or gemma")
        f = FamilyConfig.fields(raw, model_type)
        if f.bool("attention_bias", False):
            raise ConfigError("attention_bias=true is not supported by the reference models")
        if f.bool("use_sliding_window", False) or (model_type == "gemma" and f.get("sliding_window")):
            raise ConfigError("sliding-window attention is not supported by the reference models; set use_sliding_window=false")
        rope = f.sub("rope_parameters")
        rope_type = rope.str("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported; the reference models use default RoPE")
        theta = rope.float("rope_theta", None, positive=True) or f.float("rope_theta", 10000.0, positive=True)
        hidden = f.int("hidden_size", min=1)
        heads = f.int("num_attention_heads", min=1)
        layers = f.int("num_hidden_layers", min=1)
        moe = model_type == "qwen3_moe"
        sparse: frozenset = frozenset()
        if moe:
            step = f.int("decoder_sparse_step", 1, min=0) or 1
            mlp_only = set(f.list("mlp_only_layers", (), of=int))
            sparse = frozenset(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
        gemma = model_type == "gemma"
        final_norm = f.get(FINAL_NORM_KEY, "default")
        if final_norm not in ("default", "gemma") or (final_norm == "gemma" and not moe):
            raise ConfigError(f"{FINAL_NORM_KEY}={final_norm!r}: only qwen3_moe accepts it, with the value \"gemma\"")
        default_arch = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma": "GemmaForCausalLM"}[model_type]
        experts = {}
        if sparse:  # the routed experts' fields, needed once a layer is sparse
            count_key = f.first(("num_experts", "num_local_experts")) or "num_experts"
            experts = dict(num_experts=f.int(count_key, min=1), top_k=f.int("num_experts_per_tok", min=1),
                           moe_intermediate_size=f.int("moe_intermediate_size", min=1))
            if experts["top_k"] > experts["num_experts"]:
                raise ConfigError(f"{model_type} config: num_experts_per_tok={experts['top_k']} is more than the {experts['num_experts']} experts")
        return cls(
            model_type=model_type,
            architecture=(f.list("architectures", (), of=str) or (default_arch,))[0],
            vocab_size=f.int("vocab_size", min=1),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=f.int("num_key_value_heads", heads, min=1),
            head_dim=f.int("head_dim", None, min=1) or _split_width(hidden, heads),
            intermediate_size=f.int("intermediate_size", min=1),
            rms_norm_eps=f.float("rms_norm_eps", 1e-6, positive=True),
            rope_theta=theta,
            hidden_act=f.str("hidden_act", None) or f.str("hidden_activation", None) or "silu",
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            gemma_norm=gemma,
            embed_scale=hidden**0.5 if gemma else None,
            tie_word_embeddings=f.bool("tie_word_embeddings", gemma),
            **experts,
            norm_topk_prob=f.bool("norm_topk_prob", False),
            sparse_layers=sparse,
            shared_expert_intermediate_size=f.int("shared_expert_intermediate_size", 0, min=0) if moe else 0,
            fp8_reads=fp8_option(f.get("layer_boundary_fp8")),
            gemma_final_norm=final_norm == "gemma",
            hf=dict(raw),
        )

    def check_topology(self, topology) -> None:
        """Raise `ConfigError` naming the fix when the topology cannot split this model."""
        check_dense_split(self, topology)
        if self.sparse_layers:
            if self.num_experts % topology.moe_ep:
                raise ConfigError(f"num_experts={self.num_experts} is not divisible by moe_ep={topology.moe_ep}")
            if self.moe_intermediate_size % topology.moe_tp:
                raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size} is not divisible by moe_tp={topology.moe_tp}")
            if self.shared_expert_intermediate_size % topology.tp:
                raise ConfigError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} is not divisible by TP {topology.tp}")


def check_dense_split(config, topology) -> None:
    """Raise `ConfigError` naming the fix unless `topology` splits a dense decoder of `config`:
    pipeline stages over its layers, query heads and KV heads over attention TP (KV heads may be
    replicated), the MLP width over TP."""
    attn_tp, tp = topology.attn_tp, topology.tp
    if topology.pp > config.num_layers:
        raise ConfigError(f"--pp {topology.pp} is more than the {config.num_layers} layers of this model")
    if config.num_heads % attn_tp:
        raise ConfigError(
            f"num_attention_heads={config.num_heads} is not divisible by attention TP {attn_tp}; choose --tp/--attn-dp so that attention TP divides it"
        )
    kv = config.num_kv_heads
    if kv % attn_tp and attn_tp % kv:
        raise ConfigError(f"num_key_value_heads={kv} and attention TP {attn_tp} must divide one another (split or replicate KV heads)")
    if config.intermediate_size % tp:
        raise ConfigError(f"intermediate_size={config.intermediate_size} is not divisible by TP {topology.tp}")


def _split_width(hidden: int, heads: int) -> int:
    """The default head_dim, hidden_size // num_attention_heads, refused when that is 0."""
    if hidden // heads < 1:
        raise ConfigError(f"num_attention_heads={heads} is more than hidden_size={hidden}; set head_dim")
    return hidden // heads


#: the static FP8 scale of the reference models: |y| up to 8 maps onto E4M3's 448
FP8_STATIC_SCALE = 8.0 / 448.0


def fp8_option(value):
    if value in (None, "", "none"):
        return None
    fmt = value if str(value).startswith("fp8_") else f"fp8_{value}"
    if fmt not in ("fp8_dynamic", "fp8_static"):
        raise ConfigError(f"layer_boundary_fp8 must be dynamic or static, got {value!r}")
    return fmt
