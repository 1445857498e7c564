"""layer-boundary-cutedsl: CuTe DSL fused MoE finalize + all-reduce + residual add + RMSNorm kernels for layer-boundary.

    from layer_boundary_cutedsl import CuteDSLFusion, install_cutedsl_fusion, prepare_cutedsl_fusion

Names load on first use (the registry imports `plugin` without pulling in the service code).
"""

__version__ = "0.1.0"

_LAZY = {
    "CuteDSLFusion": "provider",
    "CuteDSLService": "service",
    "install_cutedsl_fusion": "service",
    "prepare_cutedsl_fusion": "service",
    "release_cutedsl_fusion": "service",
    "services_of": "service",
    "KernelSet": "kernel_set",
    "CUTEDSL_KERNELS": "kernel_set",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'layer_boundary_cutedsl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
