"""The public plugin API of layer-boundary: everything a plugin needs beyond the vocabulary
model code uses (`layer_boundary`). Plugins import these two modules and nothing else of the
core; every other module of the core is private.

Registration (one hook per extension point; `docs/plugins.md` walks through them):

| hook | record | its factory receives | and returns |
|---|---|---|---|
| `layer_boundary_fusion_providers` | `FusionProvider` | `StageDescription` | a provider (`AttentionInputFusion`, `FfnInputFusion`, `DefersFinalize`, `DefersAllReduce`) |
| `layer_boundary_residual_kinds` | `ResidualKind` | the model's options | `ResidualOps` |
| `layer_boundary_cp_paths` | `CpPathProvider` | `CpPathRequest` | the stage's CP `StagePath` |
| `layer_boundary_token_mappings` | `TokenMappingProvider` | `TokenMappingRequest` | a `CpTokenMapping` |
| `layer_boundary_overlaps` | `OverlapProvider` | `OverlapRequest` | an `Overlap` |
| `layer_boundary_branches` | `BranchProvider` | `BranchRequest` | a `BranchTransport` |
| `layer_boundary_row_publishers` | `RowPublisher` | `RowPublisherRequest` | a `PublishesRows` |
| `layer_boundary_add_norm_kernels` | `AddNormKernel` | `AddNormRequest` | `kernel(contribution, residual, weight) -> (normed, new_residual)` |
| `layer_boundary_rope_kernels` | `RopeKernel` | `RopeRequest` | `kernel(q, k, positions) -> (q, k)` |
| `layer_boundary_qk_norm_rope_kernels` | `QKNormRopeKernel` | `QKNormRopeRequest` | `kernel(q, k, positions, q_weight, k_weight) -> (q, k)` |
| `layer_boundary_decode_attention_kernels` | `DecodeAttentionKernel` | `DecodeAttentionRequest` | `kernel(q, k_cache, v_cache, slots, positions) -> out` |
| `layer_boundary_gated_activation_kernels` | `GatedActivationKernel` | `GatedActivationRequest` | `kernel(gate_up) -> act(gate) * up` |
| `layer_boundary_benchmarks` | `Benchmark` | the option strings of `layer-boundary bench` | (runs it) |

Life cycle (verbs, called on every rank): `layer_boundary_prepare_model(request:
PrepareRequest)` before the first forward and any CUDA-graph capture, and
`layer_boundary_release_model(request: ReleaseRequest)`.

Plans and paths (frozen values; CP path providers build theirs from the ordinary path):
`Stage`, `StagePlan`, `StagePath`, `EntryPath`, `ExitPath`, `ReduceScatter`, `EntryMode`,
`ExitRole`, `Owed`, the deferral rule `defers_to_next_input` and the producer-update rule
`writes_at_exit`, and the row moves `align_rows`,
`move_residual`, `dp_gather`, `dp_scatter`, `take_slice`, `gather_slices`; the reference
numerics `add_rms_norm` and the quantized reads (`Fp8Input`, `quantize_fp8`, `fp8_residual`).

Registry and loading: `get_registry`, `reset_registry`, `register_inline` /
`unregister_inline` / `inline_plugin` (tests, source checkouts), `disabled_plugins`,
`env_flag`, `LoadReport`, `Registry`, `PluginError`, `PluginLoadError`.
"""

from .._env import env_flag, env_names
from .._graph import graph_collectives, graph_key, graph_object, register_graph_object
from .._ops import align_rows, dp_gather, dp_scatter, gather_slices, move_residual, take_slice
from .._paths import EntryMode, EntryPath, ExitPath, ExitRole, Owed, ReduceScatter, StagePath, defers_to_next_input, writes_at_exit
from .._planning import Stage, StagePlan
from .._residual.add_norm import add_rms_norm, is_rms_norm
from .._residual.quant import FP8_DTYPE, Fp8Input, fp8_residual, norm_fp32, quantize_fp8
from ..models.attention import rope_cos_sin_table
from ._hookspecs import PROJECT, hookimpl, hookspec
from ._manager import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    STRICT_ENV,
    LoadReport,
    PluginError,
    PluginLoadError,
    Registry,
    disabled_plugins,
    get_plugin_manager,
    get_registry,
    inline_plugin,
    register_inline,
    reset_registry,
    unregister_inline,
)
from ._records import (
    AddNormKernel,
    Adapter,
    Benchmark,
    BranchProvider,
    CpPathProvider,
    DecodeAttentionKernel,
    FusionProvider,
    GatedActivationKernel,
    OverlapProvider,
    Priority,
    QKNormRopeKernel,
    Registered,
    ResidualKind,
    RopeKernel,
    RowPublisher,
    TokenMappingProvider,
)
from ._requests import (
    AddNormRequest,
    AttentionInputFusion,
    BranchRequest,
    BranchTransport,
    CpPathRequest,
    CpTokenMapping,
    DecodeAttentionRequest,
    DefersAllReduce,
    DefersFinalize,
    FfnInputFusion,
    GATED_ACTIVATIONS,
    GatedActivationRequest,
    Overlap,
    OverlapRequest,
    PrepareRequest,
    PublishesRows,
    QKNormRopeRequest,
    ReleaseRequest,
    RopeRequest,
    RowPublisherRequest,
    TokenMappingRequest,
)

__all__ = [
    # registration
    "PROJECT",
    "ENTRY_POINT_GROUP",
    "hookimpl",
    "hookspec",
    "Priority",
    "FusionProvider",
    "ResidualKind",
    "CpPathProvider",
    "TokenMappingProvider",
    "OverlapProvider",
    "BranchProvider",
    "RowPublisher",
    "AddNormKernel",
    "RopeKernel",
    "QKNormRopeKernel",
    "DecodeAttentionKernel",
    "GatedActivationKernel",
    "Benchmark",
    "Adapter",
    "Registered",
    # requests
    "CpPathRequest",
    "TokenMappingRequest",
    "OverlapRequest",
    "BranchRequest",
    "RowPublisherRequest",
    "AddNormRequest",
    "RopeRequest",
    "QKNormRopeRequest",
    "DecodeAttentionRequest",
    "GatedActivationRequest",
    "GATED_ACTIVATIONS",
    "PrepareRequest",
    "ReleaseRequest",
    # capabilities
    "AttentionInputFusion",
    "FfnInputFusion",
    "DefersFinalize",
    "DefersAllReduce",
    "CpTokenMapping",
    "Overlap",
    "BranchTransport",
    "PublishesRows",
    # plans and paths
    "Stage",
    "StagePlan",
    "StagePath",
    "EntryPath",
    "ExitPath",
    "ReduceScatter",
    "EntryMode",
    "ExitRole",
    "Owed",
    "defers_to_next_input",
    "writes_at_exit",
    # row moves and numerics
    "align_rows",
    "move_residual",
    "dp_gather",
    "dp_scatter",
    "take_slice",
    "gather_slices",
    "add_rms_norm",
    "is_rms_norm",
    "rope_cos_sin_table",
    # quantized reads (what a quantizing candidate returns)
    "Fp8Input",
    "FP8_DTYPE",
    "quantize_fp8",
    "norm_fp32",
    "fp8_residual",
    # registry and loading
    "Registry",
    "LoadReport",
    "PluginError",
    "PluginLoadError",
    "get_registry",
    "reset_registry",
    "get_plugin_manager",
    "register_inline",
    "unregister_inline",
    "inline_plugin",
    "disabled_plugins",
    "env_flag",
    "env_names",
    "DISABLE_ENV",
    "STRICT_ENV",
    # compiled regions (docs/compiled.md): objects a custom op finds at run time, by a string key
    "register_graph_object",
    "graph_object",
    "graph_key",
    "graph_collectives",
]
