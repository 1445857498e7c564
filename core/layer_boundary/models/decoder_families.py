"""Registers the decoder families built on `decoder.CausalLM`: qwen3, qwen3_moe and gemma."""

from __future__ import annotations

from . import ModelFamily, register_model
from .config import DecoderConfig
from .presets import preset
from .weights import load_weights, random_weights


def _build(config, parallel, *, reduction="ar", fusions=None, dtype=None, device=None, lora=None):
    from .decoder import CausalLM

    return CausalLM(config, parallel, reduction=reduction, fusions=fusions, lora=lora, dtype=dtype, device=device)


for _name, _doc in (
    ("qwen3", "dense Qwen3: GQA attention with q/k norm, SiLU gated MLP"),
    ("qwen3_moe", "Qwen3-MoE: routed experts over EP x TP, dense layers from mlp_only_layers"),
    ("gemma", "Gemma: the (1 + w) RMSNorm variant, GeGLU MLP, scaled embeddings, tied head"),
):
    register_model(
        ModelFamily(
            name=_name,
            model_type=_name,
            preset=preset(_name),
            parse=DecoderConfig.from_hf,
            build=_build,
            load_weights=load_weights,
            random_weights=random_weights,
            description=_doc,
            lora=_name == "qwen3",  # LoRA on attention and the dense MLP, checked against peft
        )
    )
