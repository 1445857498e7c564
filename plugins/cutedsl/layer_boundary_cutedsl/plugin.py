"""Hook implementations of the cutedsl plugin (records only; heavy imports stay in factories)."""

from layer_boundary.plugin import FusionProvider, Priority, hookimpl


def _decline(description):
    return None


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(
        name="cutedsl.moe_finalize_ar_add_rmsnorm", factory=_decline, priority=Priority.ARCH_SPECIFIC,
        description="MoE finalize + add + RMSNorm in CuTe DSL kernels (layer_boundary_cutedsl.kernels); the provider glue and the fused all-reduce are still to come (issue 10)",
    )
