"""Hook implementations of the tbo plugin (records only; heavy imports stay in factories)."""

from layer_boundary.plugin import Adapter, Priority, hookimpl


def _decline(description):
    return None


@hookimpl
def layer_boundary_adapters():
    yield Adapter(
        name="tbo.placeholder", kind="tbo-placeholder", factory=_decline,
        description="two-batch overlap and branches (lands with issue 7)",
    )
