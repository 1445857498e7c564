"""The plugin module: hooks that yield records, and the model life cycle. Importing it must stay
cheap (no torch work, no kernel library), because `layer-boundary plugins` and every model
build import it."""

from layer_boundary.plugin import FusionProvider, Priority, hookimpl

RECORD_NAME = "example.fused_add_rmsnorm"


def build_provider(stage):
    """Decide from the stage description alone; return None for every stage this backend
    does not handle, and only then import the implementation."""
    if stage.incoming_sum is None:  # nothing is ever owed at this input: nothing to fuse
        return None
    if not (stage.plain_update and stage.plain_read):  # residual + output, then a norm: nothing else
        return None
    if stage.norm_kind != "rms":  # Gemma's (1 + w) scaling is not implemented here
        return None
    from .fused import FusedAddRMSNorm  # a real backend imports its kernel library here

    return FusedAddRMSNorm.from_environment()


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(
        name=RECORD_NAME,
        factory=build_provider,
        priority=Priority.REFERENCE,
        description="example: all-reduce, then add + RMSNorm in one pure-torch function (float32/bfloat16/float64)",
    )


@hookimpl
def layer_boundary_prepare_model(request):
    """Size every provider of the model for its largest batch (a real backend allocates its
    workspace here, before any CUDA-graph capture; every rank runs this)."""
    from .fused import providers_of

    for provider in providers_of(request.model):
        provider.prepare(request.max_tokens)


@hookimpl
def layer_boundary_release_model(request):
    from .fused import providers_of

    for provider in providers_of(request.model):
        provider.release()
