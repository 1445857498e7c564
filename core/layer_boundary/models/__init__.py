"""Tensor-parallel reference models written against the public API (qwen3, qwen3_moe, gemma)."""

from __future__ import annotations

from .config import ConfigError, DecoderConfig, load_hf_config
from .presets import PRESETS, preset

__all__ = ["MODELS", "ConfigError", "DecoderConfig", "build_model", "load_hf_config", "model_config", "preset"]

#: model name -> the HF model_type it accepts
MODELS = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "gemma": "gemma"}


def model_config(name: str, hf_config: dict | None = None) -> DecoderConfig:
    """The DecoderConfig of model `name`: the embedded tiny default or `hf_config`."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}")
    raw = preset(name) if hf_config is None else dict(hf_config)
    if raw.get("model_type") != MODELS[name]:
        raise ConfigError(f"--model {name} needs a config with model_type {MODELS[name]!r}, got {raw.get('model_type')!r}")
    return DecoderConfig.from_hf(raw)


def build_model(config: DecoderConfig, parallel, *, reduction="ar", fusions=None, dtype=None, device=None):
    from .decoder import CausalLM

    return CausalLM(config, parallel, reduction=reduction, fusions=fusions, dtype=dtype, device=device)
