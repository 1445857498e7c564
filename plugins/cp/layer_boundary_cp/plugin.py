"""Hook implementations of the cp plugin (records only; heavy imports stay in factories)."""

from layer_boundary.plugin import Adapter, Priority, hookimpl


def _decline(description):
    return None


@hookimpl
def layer_boundary_adapters():
    yield Adapter(
        name="cp.placeholder", kind="cp-placeholder", factory=_decline,
        description="context-parallel token mapping (lands with issue 6)",
    )
