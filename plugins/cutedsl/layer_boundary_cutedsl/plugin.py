"""Hook implementations of the cutedsl plugin (records only; heavy imports stay in factories).

The registry's provider is opt-in: set LAYER_BOUNDARY_CUTEDSL=1 to give every stage a
`CuteDSLFusion` (its candidates still decline off-GPU); or pass `CuteDSLFusion()` to a stage
as its `fusions` option.
"""

import os

from layer_boundary.plugin import FusionProvider, Priority, hookimpl

ENABLE_ENV = "LAYER_BOUNDARY_CUTEDSL"


def _factory(description):
    if os.environ.get(ENABLE_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    from .provider import CuteDSLFusion

    return CuteDSLFusion()


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(
        name="cutedsl.moe_finalize_ar_add_rmsnorm", factory=_factory, priority=Priority.ARCH_SPECIFIC,
        description=(
            f"MoE finalize / TP sum, then add + RMSNorm in CuTe DSL kernels (opt-in: {ENABLE_ENV}=1); "
            "under TP one launch of the one-shot all-reduce over CUDA IPC peer buffers once a service is prepared"
        ),
    )
