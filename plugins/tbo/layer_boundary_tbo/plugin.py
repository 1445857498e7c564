"""Hook implementations of the tbo plugin: the two-batch-overlap and the branch adapters.

Both are pure torch; CUDA streams are only touched when a batch lives on a GPU.
"""

import sys

from layer_boundary.plugin import Adapter, Priority, hookimpl


def _overlap(request):
    from .overlap import TwoBatchOverlap

    return _one(TwoBatchOverlap)


def _branch(request):
    from .branch import BranchAdapter

    return _one(BranchAdapter)


_INSTANCES: dict = {}


def _one(cls):
    """One adapter object per process (they hold no per-batch state)."""
    if cls not in _INSTANCES:
        _INSTANCES[cls] = cls()
    return _INSTANCES[cls]


@hookimpl
def layer_boundary_adapters():
    yield Adapter(
        name="tbo.two_batch_overlap",
        kind="tbo",
        factory=_overlap,
        priority=Priority.REFERENCE,
        description="split a batch into two microbatches with their own streams, interleave their stages "
        "(one CUDA stream each on a GPU), merge them back",
    )
    yield Adapter(
        name="tbo.branch",
        kind="branch",
        factory=_branch,
        priority=Priority.REFERENCE,
        description="prepared branches: branch_input forks the stream, branch_output and merge_branch join it",
    )


def register_in_process() -> None:
    """Register these hooks in this process when the distribution is not installed (a source
    checkout on a bare GPU machine); a no-op when the entry point already provides them or
    LAYER_BOUNDARY_DISABLE_PLUGINS names "tbo"."""
    from layer_boundary.plugin._manager import _disabled, get_plugin_manager, get_registry

    if get_registry().adapters_of("tbo") or "tbo" in _disabled():
        return
    pm, _, provenance = get_plugin_manager()
    pm.register(sys.modules[__name__], name="tbo")
    provenance["tbo"] = ("layer-boundary-tbo (source tree)", None)
    get_registry.cache_clear()
