"""Compile kernel variants once and keep them (imports cutlass only inside functions).

Compilation needs no GPU: the host entry takes plain integers (addresses, sizes) and a
`CUstream`, so `cute.compile` gets example scalars instead of device tensors, and the target is
named explicitly (`--gpu-arch sm_90a`) instead of being read off a device. The result holds the
sm_90a cubin; the CUDA library is loaded only when an executor is bound to a device.
"""

from __future__ import annotations

import os
import threading
from typing import Optional, Union

from .tiling import AddNormVariant, MoeVariant

__all__ = ["DEFAULT_ARCH", "target_arch", "compile_variant", "get_compiled", "cache_info", "clear_cache"]

DEFAULT_ARCH = "sm_90a"
_ARCH_ENV = "LAYER_BOUNDARY_CUTEDSL_ARCH"

Variant = Union[AddNormVariant, MoeVariant]

_lock = threading.Lock()
_compiled: dict = {}


def target_arch(device=None) -> str:
    """The GPU target: $LAYER_BOUNDARY_CUTEDSL_ARCH, else the device's (sm_XY, plus 'a' from
    Hopper on), else sm_90a when no GPU is visible (compile-only use)."""
    env = os.environ.get(_ARCH_ENV, "").strip()
    if env:
        return env
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            return f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    except Exception:  # a broken driver still allows compile-only use
        pass
    return DEFAULT_ARCH


def _kernel_object(variant: Variant):
    if hasattr(variant, "kernel_object"):  # variants that name their own kernel (allreduce_layout.py)
        return variant.kernel_object()
    if isinstance(variant, AddNormVariant):
        from .add_rmsnorm_dsl import AddRMSNormKernel

        return AddRMSNormKernel(variant)
    if isinstance(variant, MoeVariant):
        from .moe_finalize_dsl import MoeFinalizeKernel

        return MoeFinalizeKernel(variant)
    raise TypeError(f"not a kernel variant: {variant!r}")


def _example_args(variant: Variant):
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32, Int64

    if hasattr(variant, "example_args"):
        return variant.example_args()
    n_addr = 5 if isinstance(variant, AddNormVariant) else 8
    return [Int64(0)] * n_addr + [Int32(1), Float32(1e-6), Int32(1), cuda.CUstream(0)]


def compile_variant(variant: Variant, arch: Optional[str] = None, *, keep_ptx_dir: Optional[str] = None):
    """Compile one variant for `arch` (default: target_arch()); no caching, no GPU needed.

    With `keep_ptx_dir`, the PTX is also written there and readable as `compiled.__ptx__`.
    """
    import cutlass.cute as cute

    arch = arch or target_arch()
    options = f"--gpu-arch {arch}"
    if keep_ptx_dir:
        os.makedirs(keep_ptx_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir {keep_ptx_dir}"
    return cute.compile(_kernel_object(variant), *_example_args(variant), options=options)


def get_compiled(variant: Variant, arch: Optional[str] = None):
    """The compiled variant for `arch`, compiled on first use (thread-safe)."""
    arch = arch or target_arch()
    key = (variant, arch)
    fn = _compiled.get(key)
    if fn is None:
        with _lock:
            fn = _compiled.get(key)
            if fn is None:
                fn = compile_variant(variant, arch)
                _compiled[key] = fn
    return fn


def cache_info() -> list:
    """(variant, arch) of every compiled kernel held."""
    return list(_compiled)


def clear_cache() -> None:
    with _lock:
        _compiled.clear()
