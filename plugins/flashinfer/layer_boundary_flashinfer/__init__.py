"""layer-boundary-flashinfer: FlashInfer's fused all-reduce + residual add + RMSNorm (and MoE
finalize) at the layer boundaries.

    from layer_boundary_flashinfer import FlashInferSettings, prepare_flashinfer_fusion, shutdown_flashinfer_fusion

    model = build_model(...)                      # every rank; weights on the GPU
    print(prepare_flashinfer_fusion(model, settings=FlashInferSettings(architecture="Qwen3ForCausalLM")))
                                                  # every rank, before any CUDA-graph capture
    ...                                           # forwards, graph capture and replay
    shutdown_flashinfer_fusion()                  # every rank, before destroy_process_group()

Names are loaded on first use, so importing the package (as the plugin registry does) stays
cheap and never imports flashinfer.
"""

__version__ = "0.1.0"

__all__ = [
    "prepare_flashinfer_fusion", "shutdown_flashinfer_fusion", "PrepareReport", "FlashInferFusion", "FlashInferSettings",
    "WorkspaceCapturedError",
]

_EXPORTS = {
    "prepare_flashinfer_fusion": "service",
    "shutdown_flashinfer_fusion": "service",
    "PrepareReport": "service",
    "FlashInferFusion": "provider",
    "FlashInferSettings": "eligibility",
    "WorkspaceCapturedError": "workspace",
}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
