"""Token axes, row layouts and named sum groups.

A `Layout` says which token axes partition a rank's rows; size-one axes are left out, so
"sharded over attention DP with attn_dp=1" is the same layout as "not sharded". It says
nothing about hidden-dimension sharding or padding: those come from the batch facts.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["TokenAxis", "Layout", "SumGroup", "standard_layouts"]


class TokenAxis(enum.Enum):
    ATTN_DP = "attn_dp"  #: different attention data-parallel token sets
    ATTN_CP = "attn_cp"  #: context-parallel partitions of an active CP batch
    ATTN_TP_SCATTER = "attn_tp_scatter"  #: token slices across attention-TP ranks

    def __repr__(self) -> str:
        return self.name


_AXIS_SIZE = {TokenAxis.ATTN_DP: "attn_dp", TokenAxis.ATTN_CP: "attn_cp", TokenAxis.ATTN_TP_SCATTER: "attn_tp"}


@attrs.frozen
class Layout:
    sharded: frozenset = attrs.field(converter=frozenset, factory=frozenset)

    @classmethod
    def sharded_over(cls, *axes: TokenAxis, sizes) -> "Layout":
        """The layout sharded over `axes`, omitting those of size one in `sizes` (a Topology)."""
        return cls(a for a in axes if getattr(sizes, _AXIS_SIZE[a]) > 1)

    def __str__(self) -> str:
        if not self.sharded:
            return "full"
        return "+".join(sorted(a.value for a in self.sharded))


class SumGroup(enum.Enum):
    """The group a sum runs over: a name, turned into a Collectives only when it runs."""

    ATTN_TP = "attn_tp"
    ATTN_CP = "attn_cp"
    TP = "tp"
    MOE_OUTPUT = "moe_output"

    @property
    def group_name(self) -> str:
        # The MoE output sum (experts over EP x TP) runs over the whole TP group.
        return "tp" if self is SumGroup.MOE_OUTPUT else self.value

    def __repr__(self) -> str:
        return self.name


def standard_layouts(topology) -> dict[str, Layout]:
    """`attention` rows, attention-TP `slice` rows and `full` rows for a topology."""
    return {
        "attention": Layout.sharded_over(TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, sizes=topology),
        "slice": Layout.sharded_over(TokenAxis.ATTN_DP, TokenAxis.ATTN_CP, TokenAxis.ATTN_TP_SCATTER, sizes=topology),
        "full": Layout(),
    }
