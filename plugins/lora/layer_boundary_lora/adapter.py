"""The LoRA row publisher bound to one stage."""

from __future__ import annotations

from layer_boundary import RowLayout, StageKind

from .rows import lora_rows

__all__ = ["LoraRowAdapter", "bind_lora_rows"]


class LoraRowAdapter:
    """Publishes which adapter each row of the stage's compute input uses (`LoraRows`).

    On an FFN it also marks the output sum fused-consumer only: the row-parallel LoRA partial
    joins the base partial, so one sum completes both; leaving that sum to the next input pays
    only when a fusion provider takes it there (`can_defer_all_reduce`).
    """

    __slots__ = ("fused_consumer_only",)

    def __init__(self, kind: StageKind):
        self.fused_consumer_only = kind is StageKind.FFN

    def publish(self, layout: RowLayout, forward):
        return lora_rows(forward, layout)

    def describe(self, layout: RowLayout) -> str:
        if layout is RowLayout.DP_GATHERED:
            return "lora (adapter ids all_gatherv@attn_dp once per forward)"
        return "lora"

    def __repr__(self) -> str:
        return f"LoraRowAdapter(fused_consumer_only={self.fused_consumer_only})"


def bind_lora_rows(stage):
    """The publisher for `stage` (construction time); refuses what it cannot publish correctly."""
    topo = stage.parallel.topology
    if topo.attn_cp > 1:
        raise NotImplementedError(
            f"stage {stage.label}: LoRA row publication does not support context parallel (attn_cp={topo.attn_cp}) "
            "yet, since the CP token order is not published to row adapters; run LoRA with attn_cp=1"
        )
    return LoraRowAdapter(stage.kind)


def row_publisher(request):
    """The `RowPublisher` factory: the LoRA rows of the request's stage (None where it has none)."""
    return bind_lora_rows(request.stage)
