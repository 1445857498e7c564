"""Hook implementations of the lora plugin (records only; the adapter is imported by its factory)."""

from layer_boundary.plugin import Adapter, Priority, hookimpl


def _bind(plan):
    from .adapter import bind_lora_rows

    return bind_lora_rows(plan)


@hookimpl
def layer_boundary_adapters():
    yield Adapter(
        name="lora.rows",
        kind="lora",
        factory=_bind,
        priority=Priority.REFERENCE,
        description="publishes each compute input's LoRA adapter per row (DP-local, DP-gathered or attention-TP slice); "
        "LoRA FFN sums defer only into a fusion that accepts them",
    )
