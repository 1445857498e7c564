"""Built-in plugin "core": the plain residual and the unfused completion, ranked last."""

from __future__ import annotations

import functools

from .._contracts import FusedMlpInput
from ..plugin._hookspecs import hookimpl
from ..plugin._records import Benchmark, FusionProvider, Priority, ResidualKind
from .._residual.add_norm import PLAIN_ADD, PLAIN_RESIDUAL


def _complete_then_read(read, norm, owed, residual, forward):
    """Complete the owed sum or finalize unfused, then the read's own add + norm (FP32
    accumulation; a quantizing read quantizes the fp32 norm output)."""
    return read.update_and_read(PLAIN_ADD, owed.complete(), residual, norm)


class UnfusedCompletion:
    """The last-resort consumer candidate: it never declines."""

    def attention_input(self, plan):
        return (
            FusedMlpInput(
                run=functools.partial(_complete_then_read, plan.read, plan.norm),
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
        description="complete the sum (or the producer's finalize), then add + RMSNorm in FP32; never declines",
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


@hookimpl
def layer_boundary_benchmarks():
    yield Benchmark.of_module(
        "layer_boundary.bench.host", name="core.host", command="host", priority=Priority.BUILTIN,
        description="host overhead of a 32-layer stack through the boundaries against the same torch ops by hand",
    )
    yield Benchmark.of_module(
        "layer_boundary.bench.compile", name="core.compile", command="compile", priority=Priority.BUILTIN,
        description="host time per forward of the 32-layer stack compiled (fullgraph) against eager and the hand-written stack compiled",
    )
    yield Benchmark.of_module(
        "layer_boundary.bench.decode", name="core.decode", command="decode", priority=Priority.BUILTIN,
        description="decode step time of a Qwen3 through the boundaries, eager against CUDA-graph replay (GPU)",
    )
