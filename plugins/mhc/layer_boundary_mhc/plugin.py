"""Hook implementations of the mhc plugin: the `mhc` residual kind (pure torch)."""

from layer_boundary.plugin import Priority, ResidualKind, hookimpl


def _build(**options):
    from .residual import build_mhc

    return build_mhc(**options)


@hookimpl
def layer_boundary_residual_kinds():
    yield ResidualKind(
        name="mhc.torch",
        kind="mhc",
        factory=_build,
        priority=Priority.REFERENCE,
        description="manifold-constrained hyper-connections: n streams, fp32 coefficients, Sinkhorn-Knopp comb; "
        "reads and updates in plain torch",
    )
