"""layer-boundary: the layer boundaries of tensor-parallel transformer inference.

A model declares its stages once (`declare_attn`, `declare_ffn`, `make_stages`) and keeps only
its compute; the boundaries complete outstanding sums, move token rows between parallel
layouts, apply residual updates and prepare normalized inputs, with fused kernels from plugins
where they apply and correct unfused code where they do not.
"""

from ._errors import Messages, MissingPluginError
from ._features import branch_input, branch_output, merge_branch, two_batch_overlap
from .collectives import Collectives, CollectiveCounter, CountingCollectives, SingleRankCollectives, TorchCollectives, split_sizes
from ._planning import StagePlan
from ._contracts import FusedMlpInput, ProducerReduction, ReductionPolicy, StageDescription, StageKind
from ._exit import FfnExit, MixerExit
from ._factories import (
    StageDeclaration,
    declare_attn,
    declare_ffn,
    layer_stack,
    make_attn_stage,
    make_ffn_stage,
    make_stages,
)
from ._forward import (
    BatchFactsError,
    BatchVariant,
    ComputeFlags,
    ComputeRows,
    DpPadding,
    Forward,
    ForwardMode,
    RowLayout,
    exit_scope_open,
    get_compute_rows,
    get_forward,
)
from ._fusions import FusionError
from ._layers import (
    ColumnParallelLinear,
    Linear,
    MoeFinalizeHandoff,
    RowParallelLinear,
    check_partial_producer,
    linear,
    reduce_output,
    reduces_itself,
    shard_cols,
    shard_rows,
)
from ._layout import Layout, SumGroup, TokenAxis
from ._output import HandoffOutput, OutputTransform, UnreducedOutput
from ._parallel import Parallel, Topology, TopologyError
from .placement import RankPlacement, current_placement, place_ranks
from ._plugins.hookspecs import hookimpl
from ._plugins.manager import get_registry
from ._plugins.records import FusionProvider, Priority, ResidualKind
from ._plugins import builtin as _builtin  # noqa: F401 - registers the built-in plugin "core"
from ._policy import resolve_reduction, resolve_speculative_reduction
from ._residual import ResidualOps, StageRead, StageUpdate, residual_kind
from ._residual import batch as residual_batch
from ._residual.add_norm import NORM_READ, PLAIN_ADD, PLAIN_RESIDUAL, GemmaRMSNorm, LayerNorm, RMSNorm
from ._residual.stream import Contribution, OwedOutput, ResidualStream, StreamState
from ._lifecycle import prepare_model, release_model
from ._stage import StageBoundary, boundaries_of

__version__ = "0.2.0"

__all__ = [
    "RankPlacement",
    "current_placement",
    "place_ranks",
    "BatchFactsError",
    "BatchVariant",
    "Collectives",
    "CollectiveCounter",
    "ColumnParallelLinear",
    "Linear",
    "linear",
    "shard_rows",
    "shard_cols",
    "ComputeFlags",
    "ComputeRows",
    "Contribution",
    "CountingCollectives",
    "DpPadding",
    "FfnExit",
    "Forward",
    "ForwardMode",
    "FusedMlpInput",
    "FusionError",
    "FusionProvider",
    "GemmaRMSNorm",
    "HandoffOutput",
    "Layout",
    "LayerNorm",
    "Messages",
    "MissingPluginError",
    "MixerExit",
    "MoeFinalizeHandoff",
    "NORM_READ",
    "OutputTransform",
    "OwedOutput",
    "PLAIN_ADD",
    "PLAIN_RESIDUAL",
    "Parallel",
    "Priority",
    "ProducerReduction",
    "RMSNorm",
    "ReductionPolicy",
    "ResidualKind",
    "ResidualOps",
    "ResidualStream",
    "StreamState",
    "RowLayout",
    "RowParallelLinear",
    "SingleRankCollectives",
    "StageBoundary",
    "prepare_model",
    "release_model",
    "boundaries_of",
    "branch_input",
    "branch_output",
    "StageDeclaration",
    "StageDescription",
    "StageKind",
    "StagePlan",
    "StageRead",
    "StageUpdate",
    "SumGroup",
    "TokenAxis",
    "Topology",
    "TopologyError",
    "TorchCollectives",
    "UnreducedOutput",
    "declare_attn",
    "declare_ffn",
    "exit_scope_open",
    "get_compute_rows",
    "get_forward",
    "get_registry",
    "hookimpl",
    "layer_stack",
    "make_attn_stage",
    "make_ffn_stage",
    "make_stages",
    "merge_branch",
    "reduce_output",
    "reduces_itself",
    "check_partial_producer",
    "residual_batch",
    "residual_kind",
    "resolve_reduction",
    "resolve_speculative_reduction",
    "split_sizes",
    "two_batch_overlap",
]
