"""Hook implementations of the flashinfer plugin (records only; flashinfer is imported on GPU
ranks by `prepare_flashinfer_fusion`, never here)."""

from __future__ import annotations

import importlib

import torch

from layer_boundary.plugin import (
    AddNormKernel, Benchmark, DecodeAttentionKernel, FusionProvider, GatedActivationKernel, Priority, RopeKernel, hookimpl,
)

from .eligibility import ENABLE_ENV, finalize_stage_reason, flashinfer_installed, plain_stage_reason, settings, stage_reason

RECORD_NAME = "flashinfer.ar_add_rmsnorm"


def hardware_ready() -> bool:
    """A CUDA device and the flashinfer package (found without importing it)."""
    return torch.cuda.is_available() and flashinfer_installed()


def build_provider(description):
    """A `FlashInferFusion` for a stage whose input the fused kernels can complete (or where
    they cannot, an output norm owed before the add or a LayerNorm or identity read, whose sum
    FlashInfer's plain all-reduce can; or, for a MoE FFN, whose output); None elsewhere, and on
    machines without CUDA or flashinfer."""
    input_ok = stage_reason(description) is None
    plain_ok = plain_stage_reason(description) is None
    finalize_ok = finalize_stage_reason(description) is None
    if not (input_ok or plain_ok or finalize_ok):
        return None
    if not hardware_ready():
        return None
    opts = settings()
    if not opts.enabled:
        return None
    finalize_ok = finalize_ok and opts.defer_finalize
    if not (input_ok or plain_ok or finalize_ok):
        return None
    from .provider import FlashInferFinalizeFusion, FlashInferFusion

    provider = (FlashInferFinalizeFusion if finalize_ok else FlashInferFusion)(description)
    provider.offers_input = input_ok
    provider.offers_plain = plain_ok
    return provider


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(
        name=RECORD_NAME,
        factory=build_provider,
        priority=Priority.VENDOR,
        contract_preparation="layer_boundary_flashinfer.testing:ContractPreparation",
        description=(
            "all-reduce + residual add + RMSNorm (and MoE finalize) in one FlashInfer trtllm kernel; "
            f"active after prepare_flashinfer_fusion(model) (Hopper/Blackwell, TP>1, one node; {ENABLE_ENV}=0 disables)"
        ),
    )


def _deferred(module: str, factory: str):
    """The factory `factory` of this package's `module`, imported at its first call (the records
    are made without importing the kernel modules or flashinfer)."""

    def build(request):
        return getattr(importlib.import_module(f"{__package__}.{module}"), factory)(request)

    build.__name__ = build.__qualname__ = f"build_{factory}"
    return build


def _kernel(kind, name: str, module: str, factory: str, description: str, **fields):
    """A `Priority.VENDOR` kernel record of `kind` whose factory is `module.factory` (deferred)."""
    return kind(name=name, factory=_deferred(module, factory), priority=Priority.VENDOR, description=description, **fields)


@hookimpl
def layer_boundary_add_norm_kernels():
    yield _kernel(AddNormKernel, "flashinfer.add_rmsnorm", "local_add_norm", "factory",
                  "residual add + RMSNorm (and Gemma's) in FlashInfer's fused_add_rmsnorm, run on copies (it works in place)",
                  norm_factory=_deferred("local_add_norm", "norm_factory"),
                  contract_preparation="layer_boundary_flashinfer.local_add_norm:contract_factory")


@hookimpl
def layer_boundary_rope_kernels():
    yield _kernel(RopeKernel, "flashinfer.rope", "decode_kernels", "rope_factory",
                  "rotary embedding of queries and keys in one FlashInfer launch (apply_rope_with_cos_sin_cache), CUDA bf16/fp16")


@hookimpl
def layer_boundary_decode_attention_kernels():
    yield _kernel(DecodeAttentionKernel, "flashinfer.decode_attention", "decode_kernels", "decode_attention_factory",
                  "decode attention over the static KV cache (BatchDecodeWithPagedKVCacheWrapper, a slot per page), CUDA bf16/fp16")


@hookimpl
def layer_boundary_gated_activation_kernels():
    yield _kernel(GatedActivationKernel, "flashinfer.gated_activation", "gated_activation", "gated_activation_factory",
                  "act(gate) * up of the gated MLP in one FlashInfer launch (silu_and_mul, gelu_tanh_and_mul, gelu_and_mul), "
                  "CUDA bf16/fp16")


@hookimpl
def layer_boundary_prepare_model(request):
    """`layer_boundary.prepare_model()`: the fusion workspaces, made (rank-agreed) before the first
    forward; `prepare_model(..., settings={"flashinfer": FlashInferSettings(...)})` passes the
    engine's enablement (its max_tokens, when set, is the workspace limit)."""
    from .service import prepare_flashinfer_fusion

    fi_settings = request.settings.get("flashinfer")
    limit = None if fi_settings is not None and fi_settings.max_tokens is not None else (min(request.max_tokens, 2048) or None)
    prepare_flashinfer_fusion(request.model, max_tokens=limit, settings=fi_settings)


@hookimpl
def layer_boundary_release_model(request):
    """`layer_boundary.release_model()`: every workspace released on every rank."""
    from .service import shutdown_flashinfer_fusion

    shutdown_flashinfer_fusion()


@hookimpl
def layer_boundary_benchmarks():
    yield Benchmark.of_module(
        "layer_boundary_flashinfer.bench", name="flashinfer.fusion", command="fusion", priority=Priority.VENDOR,
        description="the fused all-reduce + add + RMSNorm against the unfused path and raw FlashInfer (2 GPUs)",
    )
