"""Hook implementations of the lora plugin (records only; the publisher is named lazily)."""

from layer_boundary.plugin import Priority, RowPublisher, hookimpl, lazy

ROWS = ("publishes each compute input's LoRA adapter per row (DP-local, DP-gathered or attention-TP slice); LoRA FFN sums "
        "defer only into a fusion that accepts them")


@hookimpl
def layer_boundary_row_publishers():
    yield RowPublisher(name="lora.rows", kind="lora", factory=lazy("layer_boundary_lora.adapter:row_publisher"), priority=Priority.REFERENCE,
                       description=ROWS)
