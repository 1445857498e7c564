"""Hook implementations of the lora plugin (records only; the publisher is imported by its factory)."""

from layer_boundary.plugin import Priority, RowPublisher, hookimpl


def _bind(request):
    from .adapter import bind_lora_rows

    return bind_lora_rows(request.stage)


@hookimpl
def layer_boundary_row_publishers():
    yield RowPublisher(
        name="lora.rows",
        kind="lora",
        factory=_bind,
        priority=Priority.REFERENCE,
        description="publishes each compute input's LoRA adapter per row (DP-local, DP-gathered or attention-TP slice); "
        "LoRA FFN sums defer only into a fusion that accepts them",
    )
