"""Hook implementations of the mhc plugin: the `mhc` and `ihc` residual kinds (pure torch)."""

from layer_boundary.plugin import Priority, ResidualKind, hookimpl


def _mhc(**options):
    from .residual import build_mhc

    return build_mhc(**options)


def _ihc(**options):
    from .residual import build_ihc

    return build_ihc(**options)


@hookimpl
def layer_boundary_residual_kinds():
    yield ResidualKind(
        name="mhc.torch",
        kind="mhc",
        factory=_mhc,
        priority=Priority.REFERENCE,
        description="manifold-constrained hyper-connections: n streams, fp32 coefficients, Sinkhorn-Knopp comb; "
        "reads and updates in plain torch",
    )
    yield ResidualKind(
        name="mhc.ihc_torch",
        kind="ihc",
        factory=_ihc,
        priority=Priority.REFERENCE,
        description="independent hyper-connections (HY-V4): n streams, per-stream pre/post gates, no mixing matrix",
    )
