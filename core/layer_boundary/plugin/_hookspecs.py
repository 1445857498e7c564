"""Hook specifications. Each hook takes no arguments and yields frozen records.

Because the hooks take no arguments their results are fixed per process, so the registry
computes them once and every rank sees the same records in the same order. Everything that
depends on a stage or a batch goes to the records' factories, never to the hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import pluggy

if TYPE_CHECKING:  # records import torch-free modules only, but keep the spec import light
    from ._records import Adapter, FusionProvider, ResidualKind

PROJECT = "layer_boundary"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class LayerBoundarySpecs:
    @hookspec
    def layer_boundary_fusion_providers(self) -> "Iterable[FusionProvider]":
        """Yield `FusionProvider` records.

        A provider's `factory(stage)` receives a frozen `StageDescription` at model
        construction and returns a provider object (with any of `attention_input(plan)`,
        `ffn_input(plan)`, `can_defer_finalize(plan, forward)`, `can_defer_all_reduce(plan,
        forward)`) or None when it does not apply. Candidates are tried in the order
        (-priority, name) after the stage's explicit `fusions=` provider and before the
        built-in unfused completion. A runtime candidate that declines returns None before it
        touches an input or starts a collective.

        Example::

            @hookimpl
            def layer_boundary_fusion_providers():
                yield FusionProvider(name="acme.ar_add_rmsnorm", priority=200,
                                     factory=build_acme_provider,
                                     description="all-reduce + add + RMSNorm on Acme GPUs")
        """
        yield from ()

    @hookspec
    def layer_boundary_residual_kinds(self) -> "Iterable[ResidualKind]":
        """Yield `ResidualKind` records: named residual semantics (update + read pairs).

        Model code asks for one by its `kind`: `declare_attn(residual=residual_kind("mhc",
        n_streams=4))`. The record with the highest priority among those of that kind wins.
        """
        yield from ()

    @hookspec
    def layer_boundary_adapters(self) -> "Iterable[Adapter]":
        """Yield `Adapter` records: row transports that a plain prepare cannot express
        (context parallel, two-batch overlap, branches, LoRA row publication).

        The core looks adapters up by `kind` when a stage or a batch needs one; a missing kind
        raises an error that names the distribution providing it. A stage built with
        `publish_rows=(kind, ...)` binds row adapters (`factory(plan)`), told after each
        `prepare()` which rows the compute input holds (see `layer_boundary._row_publishers`).
        """
        yield from ()
