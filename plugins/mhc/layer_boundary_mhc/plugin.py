"""Hook implementations of the mhc plugin (records only; heavy imports stay in factories)."""

from layer_boundary.plugin import Adapter, Priority, hookimpl


def _decline(description):
    return None


@hookimpl
def layer_boundary_adapters():
    yield Adapter(
        name="mhc.placeholder", kind="mhc-placeholder", factory=_decline,
        description="manifold-constrained hyper-connections (lands with issue 5)",
    )
