"""The Hugging Face references of the reference families (`ModelFamily.reference`).

The command line builds the Hugging Face causal LM of a config with eager attention and eager
experts (`ReferenceRequest.hf_model`); a family adjusts that: Nemotron-H's batched experts, the
refusal of an option no Hugging Face model has, and for LoRA runs `peft` (pinned) wrapping it
with the same adapters, each request routed to its own adapter.
"""

from __future__ import annotations

import os

import torch

from layer_boundary.plugin import HfReference, ReferenceRequest

from .config import FINAL_NORM_KEY, ConfigError

__all__ = ["reference", "hf_with_lora", "require_peft", "HF_BUILD_OPTIONS", "BASE_ADAPTER"]

#: peft's name for "no adapter" in a mixed batch
BASE_ADAPTER = "__base__"

#: per model_type `from_config` options replacing the eager defaults
HF_BUILD_OPTIONS = {
    # Hugging Face's eager experts accumulate the routed sum in float32 even in a float64 model,
    # which no sharded sum can reproduce bit for bit; its batched experts do not
    "nemotron_h": {"experts_implementation": "batched_mm"},
}


def reference(request: ReferenceRequest) -> HfReference:
    """The Hugging Face model a reference family's run is checked against."""
    hf = dict(request.config.hf)
    if hf.get(FINAL_NORM_KEY, "default") != "default":
        raise ConfigError(
            f"{FINAL_NORM_KEY}={hf[FINAL_NORM_KEY]!r} is a reference-model option no Hugging Face model has; "
            "check against a single rank (--check single) instead"
        )
    model = request.hf_model(**HF_BUILD_OPTIONS.get(request.config.model_type, {}))
    count = int(request.options.get("lora") or 0)
    if not count:
        return HfReference(model)
    from .lora_layers import random_lora_spec, random_lora_weights, request_adapters

    spec = random_lora_spec(count)
    weights = random_lora_weights(request.config, spec, torch.float64, int(request.options.get("lora_seed", 0)))
    slots = request_adapters(request.requests, count, request.options.get("lora_assignment"))
    names = tuple({"adapter_names": [spec.adapters[s].name if s >= 0 else BASE_ADAPTER]} for s in slots)
    return HfReference(hf_with_lora(model, spec, weights), names)


def require_peft():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import peft
    except ImportError:
        raise ConfigError("--lora with --check hf needs peft: pip install 'layer-boundary-models[oracle]'") from None
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
