"""Hook implementations of layer-boundary-models: the reference model families, and the
choice of their attention and MLP kernels at `prepare_model`.

Every callable of a record is named lazily, so loading this module (which the registry does
whenever the distribution is installed) imports no model code.
"""

from __future__ import annotations

import functools

from layer_boundary.plugin import ModelFamily, Priority, hookimpl, lazy

_PACKAGE = __package__


def _family(model: str, description: str, *, config: str, weights: str, architecture: str, options=(), model_type=None, **fields) -> ModelFamily:
    """The record of family `model`: built by `building.build`, parsed by `config` ("module:attr"),
    weights by `weights`' `load_weights` / `random_weights`, tiny config from `presets.preset`."""
    return ModelFamily(
        name=f"models.{model}",
        model=model,
        model_type=model_type or model,
        architectures=(architecture,),
        factory=functools.partial(lazy(f"{_PACKAGE}.building:build"), model),
        parse=lazy(f"{_PACKAGE}.{config}"),
        load_weights=lazy(f"{_PACKAGE}.{weights}:load_weights"),
        random_weights=lazy(f"{_PACKAGE}.{weights}:random_weights"),
        preset=functools.partial(lazy(f"{_PACKAGE}.presets:preset"), model),
        reference=lazy(f"{_PACKAGE}.oracle:reference"),
        describe=lazy(f"{_PACKAGE}.kernel_choice:describe_model"),
        options=frozenset(options),
        priority=Priority.REFERENCE,
        description=description,
        **fields,
    )


def _realistic(model: str):
    """`realistic=` of a family with a real-width config in `presets.REALISTIC` (bench decode)."""
    return functools.partial(lazy(f"{_PACKAGE}.presets:realistic"), model)


_DECODER = dict(config="config:DecoderConfig.from_hf", weights="weights")
_SANDWICH = dict(config="gemma2_config:GemmaSandwichConfig.from_hf", weights="gemma2_family")
_RESIDUAL = dict(config="residual_config:ResidualConfig.from_hf", weights="residual_families")

#: every family this distribution ships, in the order `layer-boundary plugins` lists them
FAMILIES = (
    _family("qwen3", "dense Qwen3: GQA attention with q/k norm, SiLU gated MLP", architecture="Qwen3ForCausalLM",
            options=("lora", "fp8", "tbo"), realistic=_realistic("qwen3"), **_DECODER),
    _family("qwen3_moe", "Qwen3-MoE: routed experts over EP x TP, dense layers from mlp_only_layers",
            architecture="Qwen3MoeForCausalLM", options=("fp8", "tbo"),
            # FP8 reads flip the routing of tokens that close (measured up to 0.26 relative)
            tolerances={"fp8": 0.3}, **_DECODER),
    _family("gemma", "Gemma: the (1 + w) RMSNorm variant, GeGLU MLP, scaled embeddings, tied head",
            architecture="GemmaForCausalLM", options=("fp8", "tbo"), **_DECODER),
    _family("deepseek_v4", "DeepSeek-V4: mHC residual (layer-boundary-mhc), sliding-window MQA with sinks, MoE",
            architecture="DeepseekV4ForCausalLM", config="deepseek_v4_config:DeepseekV4Config.from_hf", weights="deepseek_v4_family",
            # HF computes the mHC projections in float32 even in a float64 model, and that float32 GEMM's
            # rounding changes with the batch's row count and the CPU thread count (measured: ~2e-7)
            tolerances={"float64": 1e-6}, requires=(("residual_kinds", "mhc"),)),
    _family("nemotron_h", "Nemotron-H: Mamba-2, attention, MLP and MoE layers, each a single stage (heterogeneous stack)",
            architecture="NemotronHForCausalLM", config="nemotron_h_family:parse", weights="nemotron_h_family",
            # its bfloat16 roundings grow further than the other families' (up to 2.4e-2): with the
            # same routing, TP 2 / TP 4 with attention DP 2 / PP 2 differ from one rank by up to
            # 4.1e-2 over 8 seeds (float16: 4.6e-3, float32: 1.3e-6)
            tolerances={"bfloat16": 6e-2}),
    _family("longcat_flash", "LongCat-Flash: two MLA attentions per layer, a MoE with zero-compute experts on the main line, "
            "and a dense FFN -> attention -> dense FFN shortcut as a prepared branch merged with it (needs layer-boundary-tbo)",
            architecture="LongcatFlashForCausalLM", config="longcat:LongcatConfig.from_hf", weights="longcat", options=("tbo",),
            # HF routes in fp32 from a float64 model too: a decode step scores one row at a time there
            # (a CPU GEMV) and a batch here (a GEMM), which round differently (~1e-7 relative)
            tolerances={"float64": 1e-5}, requires=(("branches", "branch"),)),
    _family("gemma2", "Gemma 2: sandwich (1 + w) norms, alternating sliding-window and full attention, soft-capped scores and logits",
            architecture="Gemma2ForCausalLM", **_SANDWICH),
    _family("gemma3", "Gemma 3 (text): Gemma 2's sandwich layers with per-head q/k norms and a local rope base for sliding layers",
            architecture="Gemma3ForCausalLM", model_type="gemma3_text", realistic=_realistic("gemma3"), **_SANDWICH),
    _family("olmo2", "OLMo-2: post-norm (h + norm(f(h))), q/k RMSNorms over the whole projections (a statistic across attention TP)",
            architecture="Olmo2ForCausalLM", options=("tbo",), **_RESIDUAL,
            # Hugging Face sums OLMo-2's q/k norm statistics in fp32 even in a float64 model: split over
            # attention-TP ranks the partial sums add in another order (3e-7 at TP 2 and 4; exact on one rank)
            tolerances={"float64": 1e-6}),
    _family("gpt_neox", "GPT-NeoX: LayerNorm with bias, biases on every projection, partial rotary, parallel or sequential residual",
            architecture="GPTNeoXForCausalLM", options=("tbo",), realistic=_realistic("gpt_neox"), **_RESIDUAL),
    _family("cohere", "Cohere: one LayerNorm feeding attention and MLP in parallel, interleaved rotary, per-head q/k norms, logit scale",
            architecture="CohereForCausalLM", options=("tbo",), **_RESIDUAL),
)


@hookimpl
def layer_boundary_model_families():
    yield from FAMILIES


def _ours(model) -> bool:
    """Whether `model` holds modules of this distribution (the hooks leave every other model
    alone, and import nothing for it)."""
    modules = model.modules() if hasattr(model, "modules") else ()
    return any(type(m).__module__.startswith(f"{_PACKAGE}.") for m in modules)


@hookimpl
def layer_boundary_prepare_model(request):
    """Choose (rank-agreed) the rope, decode-attention and gated-activation kernels of a
    reference model's attentions and MLPs (collective over its TP group)."""
    if _ours(request.model):
        from .attention_kernels import prepare_attention_kernels
        from .mlp_kernels import prepare_mlp_kernels

        prepare_attention_kernels(request.model)
        prepare_mlp_kernels(request.model)


@hookimpl
def layer_boundary_release_model(request):
    """The attentions and gated MLPs back to their torch path."""
    if _ours(request.model):
        from .attention_kernels import release_attention_kernels
        from .mlp_kernels import release_mlp_kernels

        release_attention_kernels(request.model)
        release_mlp_kernels(request.model)
