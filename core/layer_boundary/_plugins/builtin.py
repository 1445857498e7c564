"""Built-in plugin "core": the plain residual and the unfused completion, asked after every
other plugin's records. Importing this module registers it (`layer_boundary` imports it)."""

from __future__ import annotations

import functools
import sys

from .._contracts import FusedMlpInput
from .._residual.add_norm import PLAIN_RESIDUAL
from .hookspecs import hookimpl
from .manager import add_builtin
from .records import FusionProvider, Priority, ResidualKind


def _complete_then_read(read_complete, owed, residual, forward):
    """Complete the owed sum or finalize unfused, then the stage's local completion
    (`Stage.read_complete`): the arriving post-norm where one is owed, the add in FP32 and the
    read's norm, through the chosen local kernels (a quantizing read quantizes the fp32 norm)."""
    return read_complete(owed.complete(), residual)


class UnfusedCompletion:
    """The last-resort consumer candidate: it never declines."""

    def attention_input(self, plan):
        return (
            FusedMlpInput(
                run=functools.partial(_complete_then_read, plan.read_complete),
                name="core.unfused",
                always=True,
                preserves_residual=True,
            ),
        )

    ffn_input = attention_input


_UNFUSED = UnfusedCompletion()


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(
        name="core.unfused",
        factory=lambda stage: _UNFUSED,
        priority=Priority.BUILTIN,
        description="complete the sum (or the producer's finalize), then its post-norm, add + norm in FP32; never declines",
    )


@hookimpl
def layer_boundary_residual_kinds():
    yield ResidualKind(
        name="core.plain",
        kind="plain",
        factory=lambda: PLAIN_RESIDUAL,
        priority=Priority.BUILTIN,
        description="residual + output, then the stage's RMSNorm",
    )


add_builtin("core", sys.modules[__name__])
