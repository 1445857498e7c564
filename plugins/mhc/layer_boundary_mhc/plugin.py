"""Hook implementations of the mhc plugin: the `mhc` and `ihc` residual kinds (pure torch),
their code named lazily (imported when model code asks for a kind)."""

from layer_boundary.plugin import Priority, ResidualKind, hookimpl, lazy

MHC = ("manifold-constrained hyper-connections: n streams, fp32 coefficients, Sinkhorn-Knopp comb; reads and updates "
       "in plain torch")
IHC = "independent hyper-connections (HY-V4): n streams, per-stream pre/post gates, no mixing matrix"


@hookimpl
def layer_boundary_residual_kinds():
    residual = "layer_boundary_mhc.residual"
    yield ResidualKind(name="mhc.torch", kind="mhc", factory=lazy(f"{residual}:build_mhc"), priority=Priority.REFERENCE, description=MHC)
    yield ResidualKind(name="mhc.ihc_torch", kind="ihc", factory=lazy(f"{residual}:build_ihc"), priority=Priority.REFERENCE, description=IHC)
