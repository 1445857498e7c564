"""Hook implementations of the tbo plugin: two-batch overlap and prepared branches.

Both are pure torch; CUDA streams are only touched when a batch lives on a GPU.
"""

import sys

from layer_boundary.plugin import (
    Benchmark,
    BranchProvider,
    OverlapProvider,
    Priority,
    disabled_plugins,
    get_registry,
    hookimpl,
    register_inline,
)


def _overlap(request):
    from .overlap import TwoBatchOverlap

    return _one(TwoBatchOverlap)


def _branch(request):
    from .branch import BranchAdapter

    return _one(BranchAdapter)


_INSTANCES: dict = {}


def _one(cls):
    """One object per process (they hold no per-batch state)."""
    if cls not in _INSTANCES:
        _INSTANCES[cls] = cls()
    return _INSTANCES[cls]


@hookimpl
def layer_boundary_overlaps():
    yield OverlapProvider(
        name="tbo.two_batch_overlap",
        factory=_overlap,
        priority=Priority.REFERENCE,
        description="split a batch into two microbatches with their own streams, interleave their stages "
        "(one CUDA stream each on a GPU), merge them back",
    )


@hookimpl
def layer_boundary_branches():
    yield BranchProvider(
        name="tbo.branch",
        factory=_branch,
        priority=Priority.REFERENCE,
        description="prepared branches: branch_input forks the stream, branch_output and merge_branch join it",
    )


@hookimpl
def layer_boundary_benchmarks():
    yield Benchmark.of_module(
        "layer_boundary_tbo.bench", name="tbo.overlap", command="tbo", priority=Priority.REFERENCE,
        description="a batch's step with two-batch overlap (one or two CUDA streams) against its microbatches run apart (GPUs)",
    )


def register_in_process() -> None:
    """Register these hooks in this process when the distribution is not installed (a source
    checkout on a bare GPU machine); a no-op when the entry point already provides them or
    LAYER_BOUNDARY_DISABLE_PLUGINS names "tbo"."""
    if get_registry().overlaps or "tbo" in disabled_plugins():
        return
    register_inline(sys.modules[__name__], name="tbo", distribution="layer-boundary-tbo (source tree)")
