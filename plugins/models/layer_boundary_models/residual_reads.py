"""The stage "norm" of a post-norm layer (OLMo-2: `h = h + norm(f(h))`), written against the
public API: the sublayer reads the residual itself and its norm runs on its complete output, as
the declaration's `output_transform`. The stage's norm is `Unnormed(hidden_size)`, an identity
that names the width the boundary checks outputs against.
"""

from __future__ import annotations

from torch import nn

__all__ = ["Unnormed"]


class Unnormed(nn.Module):
    """The norm of a stage that reads the residual as it is: the identity, with the hidden size
    the boundary checks every compute output against. `norm_kind = "none"` tells the boundary
    (and fusion providers) it is the identity: a fused completion then skips the read's norm."""

    norm_kind = "none"

    def __init__(self, hidden_size: int):
        super().__init__()
        self.hidden_size = int(hidden_size)

    def forward(self, x):
        return x

    def extra_repr(self) -> str:
        return str(self.hidden_size)
