"""Stage reads for residual shapes other than pre-norm, written against the public read protocol
(`layer_boundary.StageRead`): what a model author declares for a post-norm layer and for the
second branch of a parallel residual.

- Post-norm (OLMo-2: `h = h + norm(f(h))`): the sublayer reads the residual itself and its norm
  runs on its complete output, as the declaration's `output_transform`. The stage's "norm" is
  `Unnormed(hidden_size)`, an identity that names the width the boundary checks outputs against.
- Parallel residual (GPT-NeoX, Cohere: `h = h + attn(n1(h)) + mlp(n2(h))`): two stages, the
  attention and then the MLP, whose input is the norm of the residual *before* the attention's
  output joins it. `READ_BEFORE_UPDATE` reads that way: it norms the residual it receives, then
  applies the arriving update. The attention's sum completes at the MLP's input (unfused: this
  read is not a plain norm) and the MLP's sum at the next layer's, two sums a layer.
"""

from __future__ import annotations

from torch import nn

__all__ = ["Unnormed", "ReadBeforeUpdate", "READ_BEFORE_UPDATE"]


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


class ReadBeforeUpdate:
    """The read of a parallel residual's second branch: `norm(residual)` of the residual the
    update arrives at, while the update still joins it (`update.apply(contribution, residual)`
    is the new residual). It runs on the rows the residual lives on, before any attention-DP
    gather of the input."""

    plain_norm = False
    before_gather = True

    def enter(self, hidden):
        raise RuntimeError("a parallel residual's second branch never enters the stack; declare previous= its first branch")

    def read(self, residual, norm):
        # the stream was written before this input (a producer-written update, a capture): the
        # residual the first branch read is gone, so this branch's input cannot be formed
        raise RuntimeError(
            "a parallel residual's second branch reads the residual before the first branch's update, but that update "
            "was already applied; the first branch must leave a pending plain-add contribution (not written at its exit)"
        )

    def update_and_read(self, update, contribution, residual, norm):
        return norm(residual), update.apply(contribution, residual)

    def __repr__(self) -> str:
        return "READ_BEFORE_UPDATE"


READ_BEFORE_UPDATE = ReadBeforeUpdate()
