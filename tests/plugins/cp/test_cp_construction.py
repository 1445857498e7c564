"""Which stages get a CP path at construction, what happens to those that do not, and the errors
a user sees: an unsupported active variant, a missing plugin, a bad token mapping."""

import attrs
import pytest
import torch

from layer_boundary import (
    BatchVariant,
    Forward,
    MissingPluginError,
    Priority,
    ProducerReduction,
    RMSNorm,
    RowLayout,
    Topology,
    declare_attn,
    declare_ffn,
    hookimpl,
    make_stages,
    residual_batch,
)
from layer_boundary.plugin import CpPathProvider, reset_registry
from layer_boundary_cp import TokenMapping
from layer_boundary_cp.stage import check_mapping

from cp_grid import planning_parallel

H = 8
NO_CP = "no stage boundary path for the active CONTEXT_PARALLEL batch"


planning = planning_parallel


def norm():
    return RMSNorm(H, 1e-6, dtype=torch.float64)


def layer(parallel, **kwargs):
    return make_stages((declare_attn(**kwargs), norm()), (declare_ffn(), norm()), terminal=True, parallel=parallel)


def test_every_ordinary_stage_gets_a_cp_path_and_keeps_its_ordinary_one():
    attn, ffn = layer(planning(Topology(tp=4, attn_cp=2)))
    for boundary in (attn, ffn):
        assert set(boundary.plan.paths) == {BatchVariant.ORDINARY, BatchVariant.CONTEXT_PARALLEL}
        cp = boundary.plan.paths[BatchVariant.CONTEXT_PARALLEL]
        assert cp.entry.residual_rows is cp.exit.output_rows is RowLayout.ATTN_CP_LOCAL and cp.entry.precheck is check_mapping
    described = ffn.describe()["variants"]["context_parallel"]
    assert any("all_gatherv@attn_cp" in step for step in described["entry"])
    assert any("compute all-reduces over TP" in step for step in described["exit"])


def test_a_prepared_branch_under_cp_is_rejected_at_construction():
    """Branch transport supports ordinary token rows only: the guide has construction reject CP
    for it, before any forward (and so before any collective)."""
    parallel = planning(Topology(tp=2, attn_cp=2))
    attn, ffn = make_stages((declare_attn(takes_cp_shard=True), norm()), (declare_ffn(), norm()), parallel=parallel)
    with pytest.raises(NotImplementedError, match="prepared branch transport requires ordinary token rows"):
        make_stages((declare_ffn(), norm()), prepared_from=ffn.declaration, terminal=True, parallel=parallel)


def test_attention_dp_with_cp_gathers_ffn_input_over_both():
    parallel = planning(Topology(tp=4, attn_dp=2, attn_cp=2))
    attn, ffn = make_stages(
        (declare_attn(takes_cp_shard=True), norm()), (declare_ffn(), norm()), terminal=True, parallel=parallel, reduction="rs+rsv"
    )
    assert BatchVariant.CONTEXT_PARALLEL in attn.plan.paths and BatchVariant.CONTEXT_PARALLEL in ffn.plan.paths
    steps = ffn.describe()["variants"]["context_parallel"]
    assert any("all_gatherv@attn_cp" in s and "then all_gatherv@attn_dp" in s for s in steps["entry"])
    # a mapping knows only its DP rank's partition: no reduce-scatter under attention DP, whatever the policy
    assert steps["exit"] == ["compute all-reduces over TP; keep this DP rank's rows, then this CP rank's rows of the full-row output"]


def test_shard_and_full_row_stages_describe_their_moves():
    parallel = planning(Topology(tp=2, attn_cp=2))
    shard, _ = layer(parallel, takes_cp_shard=True)
    full, _ = layer(parallel)
    shard_steps = shard.describe()["variants"]["context_parallel"]
    full_steps = full.describe()["variants"]["context_parallel"]
    assert not any("all_gatherv@attn_cp" in s for s in shard_steps["entry"])
    assert any("fetches the other rows' keys and values itself" in s for s in shard_steps["entry"])
    assert any("all_gatherv@attn_cp" in s for s in full_steps["entry"])
    assert any("take this CP rank's rows of the full-row output" in s for s in full_steps["exit"])
    (mixer,) = make_stages(
        (declare_attn(reduction=ProducerReduction.SCOPED), norm()), following=declare_ffn(), parallel=parallel, reduction="rs+rsv"
    )
    assert "leave the ATTN_TP sum (declared)" in mixer.describe()["variants"]["context_parallel"]["exit"][0]


class _Refusing:
    """A CP adapter of higher priority that knows it cannot carry attention stages."""

    @hookimpl
    def layer_boundary_cp_paths(self):
        def factory(request):
            if request.stage.declaration.is_attention_like:
                raise NotImplementedError("attention is not handled by test.refusing")
            return None

        yield CpPathProvider(name="test.refusing", factory=factory, priority=Priority.VENDOR)


class _Broken:
    @hookimpl
    def layer_boundary_cp_paths(self):
        yield CpPathProvider(name="test.broken", factory=lambda request: "a path", priority=Priority.VENDOR)


def test_adapters_are_asked_in_priority_order_and_every_reason_is_kept(inline_plugin):
    inline_plugin(_Refusing(), name="refusing")
    attn, ffn = layer(planning(Topology(tp=2, attn_cp=2)))
    # the refusing adapter is asked first; the next one carries both stages
    assert BatchVariant.CONTEXT_PARALLEL in attn.plan.paths and BatchVariant.CONTEXT_PARALLEL in ffn.plan.paths
    assert attn.plan.unsupported == {} and ffn.plan.unsupported == {}
    from layer_boundary import PLAIN_RESIDUAL

    whole = attrs.evolve(PLAIN_RESIDUAL, name="test.whole", supports_slices=False)
    attn, ffn = make_stages(
        (declare_attn(residual=whole), norm()), (declare_ffn(residual=whole), norm()), terminal=True,
        parallel=planning(Topology(tp=2, attn_cp=2)),
    )
    assert attn.plan.unsupported[BatchVariant.CONTEXT_PARALLEL] == (
        "test.refusing: attention is not handled by test.refusing; "
        "cp.stage_paths: residual kind 'test.whole' cannot read and update a share of the rows"
    )
    assert ffn.plan.unsupported[BatchVariant.CONTEXT_PARALLEL].startswith("test.refusing does not apply; cp.stage_paths: ")
    assert attn.plan.missing_variant(BatchVariant.CONTEXT_PARALLEL).startswith(NO_CP + "\nstage ")


def test_an_adapter_that_returns_something_else_is_an_error(inline_plugin):
    inline_plugin(_Broken(), name="broken")
    with pytest.raises(TypeError, match="CP path provider 'test.broken' of plugin 'broken' .* returned 'a path', which is not a StagePath"):
        layer(planning(Topology(tp=2, attn_cp=2)))


def test_without_the_plugin_a_cp_topology_names_the_distribution(monkeypatch, fresh_registry):
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "cp")
    reset_registry()
    with pytest.raises(MissingPluginError) as info:
        layer(planning(Topology(tp=2, attn_cp=2)))
    assert info.value.distribution == "layer-boundary-cp"
    assert "pip install layer-boundary-cp" in str(info.value)
    from layer_boundary.cli.runner import token_mapping

    with pytest.raises(MissingPluginError, match="pip install layer-boundary-cp"):
        token_mapping(planning(Topology(tp=2, attn_cp=2)), (3,), None, None)


def test_a_cp_batch_needs_a_token_mapping_for_its_own_rows():
    parallel = planning(Topology(tp=2, attn_cp=2))
    attn, _ = layer(parallel)
    fwd = Forward(parallel, 4, cp=(2, 2))
    residual_batch.start(fwd)
    with pytest.raises(TypeError, match="Forward\\(cp=...\\) needs a token mapping"):
        attn.prepare(torch.ones(4, H, dtype=torch.float64), fwd)
    fwd = Forward(parallel, 4, cp=TokenMapping(parallel, (2, 3)))
    residual_batch.start(fwd)
    with pytest.raises(ValueError, match="covers 5 rows but the forward has num_tokens=4"):
        attn.prepare(torch.ones(4, H, dtype=torch.float64), fwd)


def test_run_refuses_a_model_with_a_stage_without_a_cp_path(monkeypatch, fresh_registry, inline_plugin):
    """The server-argument check: `run --attn-cp` builds the model first and names the stage."""
    from layer_boundary.cli.main import UsageError
    from layer_boundary.cli.families import find_family
    from layer_boundary.cli.run_cmd import _preflight
    from layer_boundary_models import model_config

    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "cp")
    reset_registry()
    inline_plugin(_Refusing(), name="refusing")
    with pytest.raises(UsageError) as info:
        item = find_family("qwen3")
        _preflight(item, model_config("qwen3"), Topology(tp=2, attn_cp=2), "ar", {})
    assert str(info.value) == (
        f"--attn-cp 2: {NO_CP} (stage layer0.0:attention: test.refusing: attention is not handled by test.refusing)"
    )
