"""Embedded tiny Hugging Face configs: `layer-boundary run` needs no download."""

from __future__ import annotations

import copy

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


def preset(name: str) -> dict:
    return copy.deepcopy(PRESETS[name])
