"""The public plugin API of layer-boundary: everything a plugin needs beyond the vocabulary
model code uses (`layer_boundary`). Plugins import these two modules (and the documented testing
modules, `layer_boundary.testing`) and nothing else of the core; every other module of the core
is private. This module only re-exports: nothing in the core imports it.

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
| `layer_boundary_add_norm_kernels` | `AddNormKernel` | `AddNormRequest` (`PostNormRequest` for its `post_norm_factory`) | `kernel(contribution, residual, weight) -> (normed, new_residual)` |
| `layer_boundary_rope_kernels` | `RopeKernel` | `RopeRequest` | `kernel(q, k, positions) -> (q, k)` |
| `layer_boundary_qk_norm_rope_kernels` | `QKNormRopeKernel` | `QKNormRopeRequest` | `kernel(q, k, positions, q_weight, k_weight) -> (q, k)` |
| `layer_boundary_decode_attention_kernels` | `DecodeAttentionKernel` | `DecodeAttentionRequest` | `kernel(q, k_cache, v_cache, slots, positions) -> out` |
| `layer_boundary_gated_activation_kernels` | `GatedActivationKernel` | `GatedActivationRequest` | `kernel(gate_up) -> act(gate) * up` |
| `layer_boundary_benchmarks` | `Benchmark` | the option strings of `layer-boundary bench` | (runs it) |
| `layer_boundary_model_families` | `ModelFamily` | `BuildRequest` | this rank's sharded model |

Life cycle (verbs, called on every rank): `layer_boundary_prepare_model(request:
PrepareRequest)` before the first forward and any CUDA-graph capture, and
`layer_boundary_release_model(request: ReleaseRequest)`.

Plans and paths (frozen values; CP path providers build theirs from the ordinary path):
`Stage`, `StagePlan`, `StagePath`, `EntryPath`, `ExitPath`, `ReduceScatter`, `EntryMode`,
`ExitRole`, `Owed`, the deferral rule `defers_to_next_input`, the producer-update rule
`writes_at_exit` and the post-norm rule `leaves_post_norm`, and the row moves `align_rows`,
`move_residual`, `dp_gather`, `dp_scatter`, `take_slice`, `gather_slices`; the reference
numerics `add_rms_norm`, the norm kinds `norm_kind_of` and the quantized reads (`Fp8Input`, `quantize_fp8`, `fp8_residual`).

Selection (the one rule every extension point follows): `select` asks candidates in order
and records who declined and why (`Selection`, `Answer`; `recording()` collects them),
`select_agreed` settles a choice across a group's ranks; `lazy("pkg.module:attr")` names code a
record imports only when called. `check_result` holds a chosen kernel's return to its request
(shape, dtype, device: metadata only), a wrong one a `FusionError` naming the record and its
plugin (`result_problem` words it).

Model families: `StepLayout`, `DecodeLayout` (the rows of a step), `TensorSource`,
`StateDictSource` (weights by Hugging Face name), `ConfigError`, `BuildRequest`,
`ReferenceRequest`, `HfReference`; `node_hash` (which node this rank runs on);
`ConfigFields` (a config read field by field: a missing or mistyped field is one `ConfigError`
naming the family, the field and its type); `mark_unloaded` / `loads_weights` / `mark_loaded` /
`weights_loaded` (a model built without weights refuses a forward, `UnloadedWeightsError`, until
they load).

Benchmarks: `OneLineParser`, `positive_int`, `non_negative_int`, `positive_float` (options
refused as one line, exit 2), `cuda_event_us` (CUDA-event timing), `line_plot`.

Registry and loading: `get_registry`, `reset_registry`, `register_inline` /
`unregister_inline` / `inline_plugin` (tests, source checkouts), `disabled_plugins`,
`env_flag`, `LoadReport`, `Registry`, `PluginError`, `PluginLoadError`.
"""

from ._env import env_flag, env_names
from ._errors import MissingPluginError, missing_feature
from ._config_fields import REQUIRED, ConfigFields, json_type
from ._families import ConfigError, DecodeLayout, StateDictSource, StepLayout, TensorSource
from ._graph import graph_collectives, graph_key, graph_object, register_graph_object
from ._ops import align_rows, dp_gather, dp_scatter, gather_slices, move_residual, take_slice
from ._options import OneLineParser, non_negative_int, positive_float, positive_int
from ._paths import (
    EntryMode, EntryPath, ExitPath, ExitRole, Owed, ReduceScatter, StagePath, defers_to_next_input, leaves_post_norm, writes_at_exit,
)
from ._planning import Stage, StagePlan
from ._plugins.hookspecs import PROJECT, hookimpl, hookspec
from ._plugins.manager import (
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
from ._plugins.records import (
    FAMILY_OPTIONS,
    AddNormKernel,
    Benchmark,
    BranchProvider,
    CpPathProvider,
    DecodeAttentionKernel,
    FusionProvider,
    GatedActivationKernel,
    Lazy,
    ModelFamily,
    OverlapProvider,
    Priority,
    QKNormRopeKernel,
    Registered,
    ResidualKind,
    RopeKernel,
    RowPublisher,
    TokenMappingProvider,
    lazy,
)
from ._plugins.requests import (
    AddNormRequest,
    AttentionInputFusion,
    BranchRequest,
    BranchTransport,
    BuildRequest,
    CpPathRequest,
    CpTokenMapping,
    DecodeAttentionRequest,
    DefersAllReduce,
    DefersFinalize,
    FfnInputFusion,
    GATED_ACTIVATIONS,
    GatedActivationRequest,
    HfReference,
    NormSpec,
    Overlap,
    OverlapRequest,
    PostNormRequest,
    PrepareRequest,
    PublishesRows,
    QKNormRopeRequest,
    ReferenceRequest,
    ReleaseRequest,
    RopeRequest,
    RowPublisherRequest,
    TokenMappingRequest,
)
from ._plugins.results import check_result, result_problem
from ._plugins.selection import Answer, Selection, disable_hint, recording, select, select_agreed
from ._residual.add_norm import add_rms_norm, is_rms_norm, norm_kind_of
from ._residual.quant import FP8_DTYPE, Fp8Input, fp8_residual, norm_fp32, quantize_fp8
from ._rope import rope_cos_sin_table
from ._timing import cuda_event_us, line_plot
from ._weights import UnloadedWeightsError, loads_weights, mark_loaded, mark_unloaded, weights_loaded
from .nodes import node_hash

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
    "ModelFamily",
    "FAMILY_OPTIONS",
    "Registered",
    "lazy",
    "Lazy",
    # selection
    "select",
    "select_agreed",
    "Selection",
    "Answer",
    "recording",
    "disable_hint",
    "check_result",
    "result_problem",
    # requests
    "CpPathRequest",
    "TokenMappingRequest",
    "OverlapRequest",
    "BranchRequest",
    "RowPublisherRequest",
    "AddNormRequest",
    "PostNormRequest",
    "NormSpec",
    "RopeRequest",
    "QKNormRopeRequest",
    "DecodeAttentionRequest",
    "GatedActivationRequest",
    "GATED_ACTIVATIONS",
    "PrepareRequest",
    "ReleaseRequest",
    "BuildRequest",
    "ReferenceRequest",
    "HfReference",
    # capabilities
    "AttentionInputFusion",
    "FfnInputFusion",
    "DefersFinalize",
    "DefersAllReduce",
    "CpTokenMapping",
    "Overlap",
    "BranchTransport",
    "PublishesRows",
    # model families
    "StepLayout",
    "DecodeLayout",
    "TensorSource",
    "StateDictSource",
    "ConfigError",
    "ConfigFields",
    "REQUIRED",
    "json_type",
    "UnloadedWeightsError",
    "mark_unloaded",
    "mark_loaded",
    "weights_loaded",
    "loads_weights",
    "node_hash",
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
    "leaves_post_norm",
    # row moves and numerics
    "align_rows",
    "move_residual",
    "dp_gather",
    "dp_scatter",
    "take_slice",
    "gather_slices",
    "add_rms_norm",
    "is_rms_norm",
    "norm_kind_of",
    "rope_cos_sin_table",
    # quantized reads (what a quantizing candidate returns)
    "Fp8Input",
    "FP8_DTYPE",
    "quantize_fp8",
    "norm_fp32",
    "fp8_residual",
    # benchmarks
    "OneLineParser",
    "positive_int",
    "non_negative_int",
    "positive_float",
    "cuda_event_us",
    "line_plot",
    # registry and loading
    "Registry",
    "LoadReport",
    "PluginError",
    "PluginLoadError",
    "MissingPluginError",
    "missing_feature",
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
