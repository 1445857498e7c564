"""The external oracle: Hugging Face `transformers` (pinned in pyproject) built from the same
config with random weights, offline, eager attention and eager experts; for LoRA, `peft`
(pinned) wraps it with the same adapters and routes each request to its own adapter.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

__all__ = ["HF_BUILD_OPTIONS", "build_hf_model", "hf_from_state", "hf_logits", "hf_with_lora", "require_transformers", "BASE_ADAPTER"]

#: peft's name for "no adapter" in a mixed batch
BASE_ADAPTER = "__base__"


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


def require_peft():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import peft
    except ImportError:
        from .config import ConfigError

        raise ConfigError("--lora with --check hf needs peft: pip install 'layer-boundary[oracle]'") from None
    return peft


def hf_with_lora(model, spec, weights) -> "object":
    """`model` wrapped by peft with every adapter of `spec` (a `LoraSpec`) holding exactly the
    tensors of `weights` (`lora_layers.weight_name` names; every one is used, none missing)."""
    peft = require_peft()
    from peft.tuners.lora import LoraLayer

    wrapped = None
    for adapter in spec.adapters:
        config = peft.LoraConfig(
            r=adapter.rank, lora_alpha=adapter.alpha, target_modules=list(spec.targets), lora_dropout=0.0, bias="none"
        )
        if wrapped is None:
            wrapped = peft.get_peft_model(model, config, adapter_name=adapter.name)
        else:
            wrapped.add_adapter(adapter.name, config)
    unused = set(weights)
    with torch.no_grad():
        for name, module in wrapped.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            key = name.removeprefix("base_model.model.")
            for adapter in spec.adapters:
                for part, store in (("A", module.lora_A), ("B", module.lora_B)):
                    tensor_name = f"{key}.lora_{part}.{adapter.name}.weight"
                    target = store[adapter.name].weight
                    target.copy_(weights[tensor_name].to(target.dtype))
                    unused.discard(tensor_name)
    if unused:
        raise ValueError(f"{len(unused)} LoRA tensors found no peft module, e.g. {sorted(unused)[0]}")
    return wrapped.eval()


@torch.inference_mode()
def hf_logits(model, prompts: Sequence[torch.Tensor], decode_tokens: Sequence[Sequence[int]], adapters=None) -> list[list[torch.Tensor]]:
    """Per request: [prefill logits [L, V], then one [1, V] per decode step].

    Where a model only upcasts its head's output (Nemotron-H returns float32 logits from a
    float64 model), the head's output is taken instead, so a float64 comparison is not hidden
    behind float32 rounding; any other post-processing (a soft cap) keeps the model's logits.
    `adapters` (a peft model only): each request's adapter name (`BASE_ADAPTER` for none),
    routed per sample by peft's mixed-batch forward.
    """
    head_out: list = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, output: head_out.append(output))
    try:
        out = []
        for r, prompt in enumerate(prompts):
            routing = {} if adapters is None else {"adapter_names": [adapters[r]]}
            res = model(prompt[None], use_cache=True, **routing)
            cache = res.cache if hasattr(res, "cache") and res.cache is not None else res.past_key_values
            steps = [_logits(res, head_out)]
            for tokens in decode_tokens:
                res = model(torch.tensor([[tokens[r]]]), cache=cache, use_cache=True, **routing)
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
