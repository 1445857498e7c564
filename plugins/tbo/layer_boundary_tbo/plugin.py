"""Hook implementations of the tbo plugin: two-batch overlap and prepared branches.

Both are pure torch; CUDA streams are only touched when a batch lives on a GPU.
"""

import functools
import sys

from layer_boundary.plugin import (
    Benchmark,
    BranchProvider,
    OverlapProvider,
    Priority,
    disabled_plugins,
    get_registry,
    hookimpl,
    lazy,
    register_inline,
)


_INSTANCES: dict = {}


def one(cls_path: str, request=None):
    """One object of the class `module:Class` per process (they hold no per-batch state)."""
    if cls_path not in _INSTANCES:
        _INSTANCES[cls_path] = lazy(cls_path)()
    return _INSTANCES[cls_path]


OVERLAP = ("split a batch into two microbatches with their own streams, interleave their stages (one CUDA stream each on a GPU), "
           "merge them back")
BRANCH = "prepared branches: branch_input forks the stream, branch_output and merge_branch join it"
BENCH = "a batch's step with two-batch overlap (one or two CUDA streams) against its microbatches run apart (GPUs)"


@hookimpl
def layer_boundary_overlaps():
    overlap = functools.partial(one, "layer_boundary_tbo.overlap:TwoBatchOverlap")
    yield OverlapProvider(name="tbo.two_batch_overlap", factory=overlap, priority=Priority.REFERENCE, description=OVERLAP)


@hookimpl
def layer_boundary_branches():
    branch = functools.partial(one, "layer_boundary_tbo.branch:BranchAdapter")
    yield BranchProvider(name="tbo.branch", factory=branch, priority=Priority.REFERENCE, description=BRANCH)


@hookimpl
def layer_boundary_benchmarks():
    yield Benchmark.of_module("layer_boundary_tbo.bench", name="tbo.overlap", command="tbo", priority=Priority.REFERENCE, description=BENCH)


def register_in_process() -> None:
    """Register these hooks in this process when the distribution is not installed (a source
    checkout on a bare GPU machine); a no-op when the entry point already provides them or
    LAYER_BOUNDARY_DISABLE_PLUGINS names "tbo"."""
    if get_registry().overlaps or "tbo" in disabled_plugins():
        return
    register_inline(sys.modules[__name__], name="tbo", distribution="layer-boundary-tbo (source tree)")
