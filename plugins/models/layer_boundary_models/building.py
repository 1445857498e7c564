"""Building a reference model for a `BuildRequest`: what every family record's factory runs.

The run options a family declares (`ModelFamily.options`) arrive in `request.options`: "lora"
(an adapter count, drawn as `random_lora_spec`, or a `LoraSpec`, with "lora_seed" and "lora_assignment" kept on
the model for its weights and its rows' adapters) and "fp8" (FP8 reads at attention and dense
FFN inputs).
"""

from __future__ import annotations

import importlib

import attrs

from layer_boundary.plugin import BuildRequest, mark_unloaded

from .config import fp8_option

__all__ = ["build", "UNLOADED"]

#: the refusal of a forward before the weights load, naming both ways to load them
UNLOADED = (
    "this {family} model was built without weights (its parameters are uninitialised memory): "
    "load them first, layer_boundary_models.load_weights(model, weights) with a state dict (random_weights(config)) "
    "or a save_pretrained() folder"
)

#: family -> (module, model class)
MODEL_CLASSES = {
    "qwen3": ("decoder", "CausalLM"),
    "qwen3_moe": ("decoder", "CausalLM"),
    "gemma": ("decoder", "CausalLM"),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4ForCausalLM"),
    "nemotron_h": ("nemotron_h", "NemotronHForCausalLM"),
    "longcat_flash": ("longcat", "LongcatForCausalLM"),
    "gemma2": ("gemma2", "GemmaSandwichLM"),
    "gemma3": ("gemma2", "GemmaSandwichLM"),
    "olmo2": ("residual_models", "ResidualCausalLM"),
    "gpt_neox": ("residual_models", "ResidualCausalLM"),
    "cohere": ("residual_models", "ResidualCausalLM"),
}


def model_class(family: str):
    module, name = MODEL_CLASSES[family]
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def build(family: str, request: BuildRequest):
    """This rank's model of family `family` for `request`: its parameters are uninitialised
    memory, so its forward refuses to run until its weights load (`UNLOADED`)."""
    options = dict(request.options)
    config = request.config
    extra = {}
    if options.get("fp8"):
        config = attrs.evolve(config, fp8_reads=fp8_option(options["fp8"]))
    if options.get("lora"):
        from .lora_layers import LoraSpec, random_lora_spec

        lora = options["lora"]
        extra["lora"] = lora if isinstance(lora, LoraSpec) else random_lora_spec(int(lora))
    model = model_class(family)(
        config, request.parallel, reduction=request.reduction, fusions=request.fusions, dtype=request.dtype, device=request.device, **extra
    )
    if "lora" in extra:
        model.lora_seed = int(options.get("lora_seed", 0))
        model.lora_assignment = options.get("lora_assignment")
    return mark_unloaded(model, UNLOADED.format(family=family))
