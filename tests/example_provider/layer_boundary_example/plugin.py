"""The plugin module: one hook that yields one record. Importing it must stay cheap (no torch
work, no kernel library), because `layer-boundary plugins` and every model build import it."""

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
