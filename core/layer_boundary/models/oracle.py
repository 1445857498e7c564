"""The external oracle: Hugging Face `transformers` (pinned in pyproject) built from the same
config with random weights, offline, eager attention and eager experts.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

__all__ = ["HF_BUILD_OPTIONS", "build_hf_model", "hf_from_state", "hf_logits", "require_transformers"]


def require_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        from .config import ConfigError

        raise ConfigError("--check hf needs Hugging Face transformers: pip install 'layer-boundary[oracle]'") from None
    return transformers


_EAGER = {"attn_implementation": "eager", "experts_implementation": "eager"}

#: per model_type overrides of the implementations above, registered by a model family
HF_BUILD_OPTIONS: dict[str, dict] = {}


def _options(model_type: str) -> dict:
    return {**_EAGER, **HF_BUILD_OPTIONS.get(model_type, {})}


def build_hf_model(hf_config: dict, dtype: torch.dtype):
    """The HF model of `hf_config` (weights uninitialised; load them next)."""
    from .config import FINAL_NORM_KEY, ConfigError

    if hf_config.get(FINAL_NORM_KEY, "default") != "default":
        raise ConfigError(
            f"{FINAL_NORM_KEY}={hf_config[FINAL_NORM_KEY]!r} is a reference-model option no Hugging Face model has; "
            "check against a single rank (--check single) instead"
        )
    transformers = require_transformers()
    cfg = dict(hf_config)
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    return transformers.AutoModelForCausalLM.from_config(config, **_options(model_type)).to(dtype).eval()


def hf_from_state(hf_config: dict, state: dict, dtype: torch.dtype):
    """The HF model of `hf_config` holding exactly the weights of `state` (strict)."""
    model = build_hf_model(hf_config, dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model


def hf_from_checkpoint(folder: str, dtype: torch.dtype):
    transformers = require_transformers()
    model_type = transformers.AutoConfig.from_pretrained(folder).model_type
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **_options(model_type)).eval()


@torch.inference_mode()
def hf_logits(model, prompts: Sequence[torch.Tensor], decode_tokens: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
    """Per request: [prefill logits [L, V], then one [1, V] per decode step].

    Where a model only upcasts its head's output (Nemotron-H returns float32 logits from a
    float64 model), the head's output is taken instead, so a float64 comparison is not hidden
    behind float32 rounding; any other post-processing (a soft cap) keeps the model's logits.
    """
    head_out: list = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, output: head_out.append(output))
    try:
        out = []
        for r, prompt in enumerate(prompts):
            res = model(prompt[None], use_cache=True)
            cache = res.cache if hasattr(res, "cache") and res.cache is not None else res.past_key_values
            steps = [_logits(res, head_out)]
            for tokens in decode_tokens:
                res = model(torch.tensor([[tokens[r]]]), cache=cache, use_cache=True)
                cache = res.cache if getattr(res, "cache", None) is not None else res.past_key_values
                steps.append(_logits(res, head_out))
            out.append(steps)
    finally:
        hook.remove()
    return out


def _logits(res, head_out: list) -> torch.Tensor:
    head = head_out.pop()[0]
    head_out.clear()
    logits = res.logits[0]
    if head.dtype != logits.dtype and head.shape == logits.shape and torch.equal(head.to(logits.dtype), logits):
        return head.clone()
    return logits.clone()
