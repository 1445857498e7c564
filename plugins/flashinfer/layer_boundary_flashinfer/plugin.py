"""Hook implementations of the flashinfer plugin (records only; heavy imports stay in factories)."""

from layer_boundary.plugin import FusionProvider, Priority, hookimpl


def _decline(description):
    return None


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(
        name="flashinfer.ar_add_rmsnorm", factory=_decline, priority=Priority.VENDOR,
        description="all-reduce + residual add + RMSNorm through flashinfer.comm (lands with issue 9)",
    )
