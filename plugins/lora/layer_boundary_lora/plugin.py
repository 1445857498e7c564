"""Hook implementations of the lora plugin (records only; heavy imports stay in factories)."""

from layer_boundary.plugin import Adapter, Priority, hookimpl


def _decline(description):
    return None


@hookimpl
def layer_boundary_adapters():
    yield Adapter(
        name="lora.placeholder", kind="lora-placeholder", factory=_decline,
        description="LoRA row publication (lands with issue 8)",
    )
