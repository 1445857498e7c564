"""The record `layer-boundary run`, `plan` and `bench decode` find (`--model llama`)."""

from layer_boundary.plugin import ModelFamily, Priority, hookimpl, lazy

_MODEL = "layer_boundary_example_family.model"


@hookimpl
def layer_boundary_model_families():
    yield ModelFamily(
        name="example_family.llama",
        model="llama",
        model_type="llama",
        architectures=("LlamaForCausalLM",),
        factory=lazy(f"{_MODEL}:build"),
        parse=lazy(f"{_MODEL}:LlamaConfig.from_hf"),
        load_weights=lazy(f"{_MODEL}:load_weights"),
        random_weights=lazy(f"{_MODEL}:random_weights"),
        preset=lazy(f"{_MODEL}:tiny_config"),
        realistic=lazy(f"{_MODEL}:realistic_config"),
        priority=Priority.REFERENCE,
        description="Llama: GQA attention with rotary embeddings, SiLU gated MLP, RMSNorm (a third party's family)",
    )
