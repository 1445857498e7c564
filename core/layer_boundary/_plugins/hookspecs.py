"""Hook specifications: one hook per extension point.

Registration hooks take no arguments and yield frozen records; their results are fixed per
process, so the registry computes them once and every rank sees the same records in the same
order. What depends on a stage or a batch goes to the records' factories, as a typed request.
Life-cycle hooks are verbs: the core calls them with a typed request on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import pluggy

if TYPE_CHECKING:  # keep the spec import light
    from . import records
    from . import requests

PROJECT = "layer_boundary"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class LayerBoundarySpecs:
    # ---- registration hooks: records -------------------------------------------------------

    @hookspec
    def layer_boundary_fusion_providers(self) -> "Iterable[records.FusionProvider]":
        """Yield `FusionProvider` records: fused completion of what a stage's input owes.

        `factory(stage)` receives a frozen `StageDescription` at model construction and
        returns a provider object (capabilities: `AttentionInputFusion`, `FfnInputFusion`,
        `DefersFinalize`, `DefersAllReduce`) or None when it does not apply. Candidates are
        tried in the order (-priority, name), after the stage's explicit `fusions=` provider
        and before the built-in unfused completion. A candidate that declines returns None
        before it touches an input or starts a collective.

        Example::

            @hookimpl
            def layer_boundary_fusion_providers():
                yield FusionProvider(name="acme.ar_add_rmsnorm", priority=Priority.VENDOR,
                                     factory=build_acme_provider,
                                     description="all-reduce + add + RMSNorm on Acme GPUs")
        """
        yield from ()

    @hookspec
    def layer_boundary_residual_kinds(self) -> "Iterable[records.ResidualKind]":
        """Yield `ResidualKind` records: named residual semantics (update + read pairs).

        Model code asks for one by its `kind`, with the options its factory takes; the
        highest-priority record of that kind wins. The mhc plugin's kind, for example::

            ops = residual_kind("mhc", streams=4, attn=attn_mapping, ffn=ffn_mapping, head=head)
            declare_attn(residual=ops), declare_ffn(residual=ops)
        """
        yield from ()

    @hookspec
    def layer_boundary_cp_paths(self) -> "Iterable[records.CpPathProvider]":
        """Yield `CpPathProvider` records: the context-parallel path of a stage.

        Asked for every stage when the topology has attention CP > 1: `factory(request)`
        receives a `CpPathRequest` (the stage's facts and its ordinary path) and returns a
        `StagePath` for `BatchVariant.CONTEXT_PARALLEL`, None, or raises
        `NotImplementedError(reason)`. A stage no provider takes has no CP path: its CP batches
        raise the guide's `no stage boundary path for the active CONTEXT_PARALLEL batch`.
        """
        yield from ()

    @hookspec
    def layer_boundary_token_mappings(self) -> "Iterable[records.TokenMappingProvider]":
        """Yield `TokenMappingProvider` records: `factory(request)` receives a
        `TokenMappingRequest` and returns the token mapping of a CP batch (`Forward(cp=...)`)."""
        yield from ()

    @hookspec
    def layer_boundary_overlaps(self) -> "Iterable[records.OverlapProvider]":
        """Yield `OverlapProvider` records: `factory(request)` receives an `OverlapRequest` and
        returns what `two_batch_overlap(forward)` gives the model (an `Overlap`), or None."""
        yield from ()

    @hookspec
    def layer_boundary_branches(self) -> "Iterable[records.BranchProvider]":
        """Yield `BranchProvider` records: `factory(request)` receives a `BranchRequest` and
        returns what `branch_input`, `branch_output` and `merge_branch` run on (a
        `BranchTransport`), or None."""
        yield from ()

    @hookspec
    def layer_boundary_row_publishers(self) -> "Iterable[records.RowPublisher]":
        """Yield `RowPublisher` records of a `kind`: a stage built with `publish_rows=(kind,)`
        binds the first whose `factory(request)` (a `RowPublisherRequest`) returns an object
        (`PublishesRows`); after every `prepare()` the stage publishes each bound publisher's
        per-row facts on the compute input's rows (`get_compute_rows()`)."""
        yield from ()

    @hookspec
    def layer_boundary_add_norm_kernels(self) -> "Iterable[records.AddNormKernel]":
        """Yield `AddNormKernel` records: local add + RMSNorm kernels (no collective).

        Every plain add + RMSNorm read that no fusion provider takes (TP=1, after an unfused
        all-reduce, the final norm, Gemma norms) runs the first record whose
        `factory(request)` (an `AddNormRequest`: device, dtypes, width, offset, eps) returns a
        kernel, chosen once per norm, device and dtypes; the norm's torch path runs when none does.
        """
        yield from ()

    @hookspec
    def layer_boundary_rope_kernels(self) -> "Iterable[records.RopeKernel]":
        """Yield `RopeKernel` records: rotary kernels of the reference attention (static-cache
        path). `factory(request)` (a `RopeRequest`) runs once per model at `prepare_model`; the
        first record all ranks of the TP group accept wins; torch rotation when none does."""
        yield from ()

    @hookspec
    def layer_boundary_qk_norm_rope_kernels(self) -> "Iterable[records.QKNormRopeKernel]":
        """Yield `QKNormRopeKernel` records: the q/k norms and the rotation of the reference
        attention (static-cache path) in one kernel. `factory(request)` (a `QKNormRopeRequest`)
        runs once per model with q/k norms at `prepare_model`; chosen like rope kernels
        (rank-agreed, torch last)."""
        yield from ()

    @hookspec
    def layer_boundary_decode_attention_kernels(self) -> "Iterable[records.DecodeAttentionKernel]":
        """Yield `DecodeAttentionKernel` records: decode attention over the reference models'
        static KV cache. `factory(request)` (a `DecodeAttentionRequest`) runs once per model at
        `prepare_model`; chosen like rope kernels (rank-agreed, torch last)."""
        yield from ()

    @hookspec
    def layer_boundary_gated_activation_kernels(self) -> "Iterable[records.GatedActivationKernel]":
        """Yield `GatedActivationKernel` records: `act(gate) * up` of the reference models' gated
        MLP in one kernel. `factory(request)` (a `GatedActivationRequest`) runs once per model and
        MLP width at `prepare_model`; chosen like rope kernels (rank-agreed, torch last)."""
        yield from ()

    @hookspec
    def layer_boundary_benchmarks(self) -> "Iterable[records.Benchmark]":
        """Yield `Benchmark` records: `layer-boundary bench COMMAND [options]` runs the record
        whose `command` it names, `factory(options)`."""
        yield from ()

    @hookspec
    def layer_boundary_model_families(self) -> "Iterable[records.ModelFamily]":
        """Yield `ModelFamily` records: model families `layer-boundary run`, `plan` and `bench
        decode` build and check by name (`--model NAME`), a third party's as the reference
        ones. The family's modules are named lazily (`lazy("pkg.module:attr")`), so listing
        plugins imports no model code."""
        yield from ()

    # ---- life-cycle hooks: verbs ----------------------------------------------------------

    @hookspec
    def layer_boundary_prepare_model(self, request: "requests.PrepareRequest") -> None:
        """Prepare a model before its first forward and before any CUDA-graph capture:
        workspaces, compiled kernels, agreements across ranks (`request.model`,
        `request.max_tokens`). Called on every rank, in plugin-name order, by
        `layer_boundary.prepare_model()`; a collective here must run on every rank."""

    @hookspec
    def layer_boundary_release_model(self, request: "requests.ReleaseRequest") -> None:
        """Release what `layer_boundary_prepare_model` created. Called on every rank, in reverse
        plugin-name order, by `layer_boundary.release_model()`, before the process groups go."""
