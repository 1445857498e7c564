"""Hook implementations of the cutedsl plugin (records only; heavy imports stay in factories).

The registry's provider is opt-in: set LAYER_BOUNDARY_CUTEDSL=1 to give every stage a
`CuteDSLFusion` (its candidates still decline off-GPU); or pass `CuteDSLFusion()` to a stage
as its `fusions` option. Either way `layer_boundary.prepare_model(model, max_tokens=...)`
installs the model's service (`install_cutedsl_fusion`) and prepares it, and
`layer_boundary.release_model(model)` releases it: the same life cycle as every fusion plugin.

The local add + RMSNorm kernel ("cutedsl.add_rmsnorm", `local_add_norm.py`) needs no opt-in:
installed, it runs every plain add + RMSNorm no fusion takes (TP=1, the final norm, ...) on CUDA
bf16/fp16 rows, and declines everything else; "cutedsl.local_norms" likewise runs the add +
LayerNorm and the post-norm + add + norm of post-norm and sandwich layers. So does the q/k norm + rope kernel
("cutedsl.qk_norm_rope", `qk_norm_rope_kernel.py`): qwen3-style attentions' two per-head norms
and the rope in one launch on the static-cache path; and the gated activation
("cutedsl.gated_activation", `gated_activation_kernel.py`): the gated MLP's act(gate) * up.
"""

from layer_boundary.plugin import (
    AddNormKernel,
    Benchmark,
    FusionProvider,
    GatedActivationKernel,
    Priority,
    QKNormRopeKernel,
    env_flag,
    hookimpl,
)

ENABLE_ENV = "LAYER_BOUNDARY_CUTEDSL"


def _factory(description):
    if not env_flag(ENABLE_ENV):
        return None
    from .provider import CuteDSLFusion

    return CuteDSLFusion()


@hookimpl
def layer_boundary_fusion_providers():
    yield FusionProvider(
        name="cutedsl.moe_finalize_ar_add_rmsnorm", factory=_factory, priority=Priority.ARCH_SPECIFIC,
        contract_preparation="layer_boundary_cutedsl.testing:ContractPreparation",
        description=(
            f"MoE finalize / TP sum, then add + RMSNorm in CuTe DSL kernels (opt-in: {ENABLE_ENV}=1); "
            "under TP one launch of the one-shot all-reduce over CUDA IPC peer buffers once a service is prepared"
        ),
    )


class _Lazy:
    """A record factory that imports its module of this package on the first call (the registry
    loads this module without the kernels' code) and calls its `attr`."""

    def __init__(self, module: str, attr: str = "factory"):
        self.module = module
        self.attr = attr

    def __call__(self, request):
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{self.module}"), self.attr)(request)


@hookimpl
def layer_boundary_add_norm_kernels():
    yield AddNormKernel(
        name="cutedsl.add_rmsnorm", factory=_Lazy("local_add_norm"), priority=Priority.ARCH_SPECIFIC,
        contract_preparation="layer_boundary_cutedsl.local_add_norm:contract_factory",
        description="residual add + RMSNorm (and Gemma's) in one CuTe DSL kernel, out of place; CUDA bf16/fp16 rows",
    )
    yield AddNormKernel(
        name="cutedsl.local_norms", factory=_Lazy("local_add_norm", "norms_factory"), priority=Priority.ARCH_SPECIFIC,
        post_norm_factory=_Lazy("local_add_norm", "post_norm_factory"), norm_kinds=("rms", "gemma_rms", "layer"),
        contract_preparation="layer_boundary_cutedsl.local_add_norm:norms_contract_factory",
        description=("residual add + LayerNorm (with or without a bias), and an RMS post-norm + add + the read's norm (Gemma's "
                     "sandwich, OLMo-2) in one CuTe DSL kernel; CUDA bf16/fp16 rows"),
    )


@hookimpl
def layer_boundary_qk_norm_rope_kernels():
    yield QKNormRopeKernel(
        name="cutedsl.qk_norm_rope", factory=_Lazy("qk_norm_rope_kernel"), priority=Priority.ARCH_SPECIFIC,
        description="qwen3's per-head q/k RMSNorms and the rope in one CuTe DSL kernel; CUDA bf16/fp16, head_dim 64/128/256",
    )


@hookimpl
def layer_boundary_gated_activation_kernels():
    yield GatedActivationKernel(
        name="cutedsl.gated_activation", factory=_Lazy("gated_activation_kernel"), priority=Priority.ARCH_SPECIFIC,
        description="act(gate) * up (silu, gelu_tanh, gelu) in one CuTe DSL kernel, a token's row over many CTAs; CUDA bf16/fp16",
    )


@hookimpl
def layer_boundary_prepare_model(request):
    """Install the model's CuTe DSL service (when its stages have `CuteDSLFusion` providers and
    none is installed yet) and prepare it for `request.max_tokens` (a vote over the TP group)."""
    from .service import prepare_model_fusion

    prepare_model_fusion(request.model, max_tokens=request.max_tokens)


@hookimpl
def layer_boundary_release_model(request):
    """Release the workspaces of the model's CuTe DSL services; nothing defers until the next prepare."""
    from .service import release_cutedsl_fusion

    release_cutedsl_fusion(request.model)


@hookimpl
def layer_boundary_benchmarks():
    yield Benchmark.of_module(
        "layer_boundary_cutedsl.bench", name="cutedsl.kernels", command="cutedsl", priority=Priority.ARCH_SPECIFIC,
        description="the CuTe DSL kernels checked, then timed against the copy bandwidth and unfused torch (one GPU)",
    )
