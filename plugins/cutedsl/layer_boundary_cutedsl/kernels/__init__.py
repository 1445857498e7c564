"""CuTe DSL kernels of the cutedsl plugin and their float64 torch references.

Importing this package imports torch only: cutlass is imported when a kernel is first compiled
(`compiler.py`), so the plugin loads on machines without nvidia-cutlass-dsl or a GPU.
"""

from .add_rmsnorm import fused_add_rmsnorm, prepare_add_rmsnorm
from .moe_finalize import (
    finalize_handoff_add_rmsnorm,
    handoff_args,
    moe_finalize,
    moe_finalize_add_rmsnorm,
    prepare_moe_finalize,
)
from .reference import add_rmsnorm_reference, dense_indices, moe_finalize_add_rmsnorm_reference, moe_finalize_reference
from .tiling import AddNormVariant, MoeVariant

__all__ = [
    "fused_add_rmsnorm",
    "prepare_add_rmsnorm",
    "moe_finalize_add_rmsnorm",
    "moe_finalize",
    "prepare_moe_finalize",
    "handoff_args",
    "finalize_handoff_add_rmsnorm",
    "add_rmsnorm_reference",
    "moe_finalize_reference",
    "moe_finalize_add_rmsnorm_reference",
    "dense_indices",
    "AddNormVariant",
    "MoeVariant",
]
