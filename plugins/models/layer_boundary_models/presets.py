"""Embedded tiny Hugging Face configs: `layer-boundary run` needs no download."""

from __future__ import annotations

import copy
import importlib

_COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 512,
    "attention_bias": False,
    "attention_dropout": 0.0,
}

PRESETS = {
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    "qwen3_moe": {
        **_COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "gemma": {
        **_COMMON,
        "model_type": "gemma",
        "architectures": ["GemmaForCausalLM"],
        "num_key_value_heads": 1,
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    # every feature of the sandwich families at a tiny size: a window shorter than the prompts,
    # both layer types on each of two pipeline stages, soft caps that bend the scores and
    # logits, query_pre_attn_scalar unlike head_dim, and (Gemma 3) a linear-scaled full rope
    "gemma2": {
        **_COMMON,
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 24,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
    },
    "gemma3": {
        **_COMMON,
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 24,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": 5.0,
    },
}


#: olmo2, gpt_neox and cohere exercise every feature their family has: OLMo-2's q/k norms over the
#: whole projections with KV heads that attention TP 4 replicates, GPT-NeoX's biases and partial
#: rotary with the parallel residual, Cohere's per-head q/k norms, a logit scale other than the
#: default and a tied head
_RESIDUAL_COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

RESIDUAL_PRESETS = {
    "olmo2": {
        **_RESIDUAL_COMMON,
        "model_type": "olmo2",
        "architectures": ["Olmo2ForCausalLM"],
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    "gpt_neox": {
        **_RESIDUAL_COMMON,
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "use_parallel_residual": True,
        "attention_bias": True,
        "tie_word_embeddings": False,
    },
    "cohere": {
        **_RESIDUAL_COMMON,
        "model_type": "cohere",
        "architectures": ["CohereForCausalLM"],
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "layer_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "use_qk_norm": True,
        "logit_scale": 0.25,
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
}

PRESETS.update(RESIDUAL_PRESETS)


#: families whose tiny config lives beside their model code: (module, constant)
_ELSEWHERE = {
    "deepseek_v4": ("deepseek_v4_family", "PRESET"),
    "nemotron_h": ("nemotron_h_family", "PRESET"),
    "longcat_flash": ("longcat", "PRESET"),
}


def preset(name: str) -> dict:
    """A fresh copy of family `name`'s embedded tiny config."""
    if name in _ELSEWHERE:
        module, constant = _ELSEWHERE[name]
        return copy.deepcopy(getattr(importlib.import_module(f"{__package__}.{module}"), constant))
    return copy.deepcopy(PRESETS[name])


#: real-width configs for `layer-boundary bench decode` (8 layers; the bench sets
#: num_hidden_layers), with a 32000-token vocabulary so the head does not dominate a step
REALISTIC = {
    # Qwen3-8B's widths
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # Gemma 3 12B's widths and attention: five sliding-window (1024) layers to one global, the
    # pattern given by sliding_window_pattern so it holds for any layer count; local rope base
    # 10000, global 1e6 with Gemma 3's linear factor 8; tied head, no soft caps
    "gemma3": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 3840,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "intermediate_size": 15360,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
    # Pythia-6.9B's widths: 32 heads of 128 with a quarter of each rotated, the parallel residual,
    # biases on every projection, an ungated GELU MLP of 4x the width
    "gpt_neox": {
        "model_type": "gpt_neox",
        "architectures": ["GPTNeoXForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "num_hidden_layers": 8,
        "num_attention_heads": 32,
        "intermediate_size": 16384,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "use_parallel_residual": True,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
    },
}


def realistic(name: str) -> dict:
    """A fresh copy of family `name`'s real-width config, the one `bench decode` times."""
    return copy.deepcopy(REALISTIC[name])
