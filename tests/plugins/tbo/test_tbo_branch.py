"""Prepared branches (LongCat's shortcut): bit-exact against the plain formula on every topology,
with TBO on top, and the guide's branch errors."""

import pytest
import torch

from layer_boundary import (
    Forward,
    Messages as CoreMessages,
    MissingPluginError,
    Parallel,
    RMSNorm,
    Topology,
    branch_input,
    branch_output,
    declare_ffn,
    layer_stack,
    make_stages,
    merge_branch,
    residual_batch,
)
from layer_boundary.testing import requires_plugins
from layer_boundary.testing.threaded import ThreadWorld, run_threaded

from tbo_exact_branch import BranchStack, plain_reference, run_branch_rank
from tbo_exact_stack import inputs_of, split_of

CASES = {
    "tp1": (Topology(tp=1), [[2, 1, 3]], {}),
    "tp2": (Topology(tp=2), [[2, 1, 3]], {}),
    "tp4-ep2": (Topology(tp=4, moe_ep=2), [[3, 1, 1]], {}),
    "dp2xtp1": (Topology(tp=2, attn_dp=2), [[2, 1], [3]], {"policy": "rsv"}),
    "dp2xtp2": (Topology(tp=4, attn_dp=2), [[2, 1, 3], [1, 1]], {"policy": "rs+rsv"}),
    "dp2xtp2-zero": (Topology(tp=4, attn_dp=2), [[], [2, 2]], {"policy": "ar", "padding": "max_len"}),
}


def _check(results, topology, dp_segments):
    ref = plain_reference(dp_segments)
    for rank, out in enumerate(results):
        want = ref[topology.coordinates(rank)["attn_dp"]]
        assert torch.equal(out, want), f"rank {rank}: max diff {(out - want).abs().max().item()}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tbo", [False, True], ids=["serial", "tbo"])
def test_branch_stack_matches_the_plain_formula(case, tbo):
    topology, dp_segments, kwargs = CASES[case]
    split = split_of(dp_segments) if tbo else None
    _check(run_threaded(run_branch_rank, topology, dp_segments, tbo=tbo, split=split, **kwargs), topology, dp_segments)


def test_the_formula_check_sees_a_residual_added_twice(monkeypatch):
    """A merge that also added the main line's residual would fail the comparison."""
    import layer_boundary_tbo.branch as branch

    dp_segments = [[2, 1, 3]]
    right = run_branch_rank(Parallel.single(), dp_segments)
    assert torch.equal(right, plain_reference(dp_segments)[0])
    real = branch.BranchAdapter.merge_branch

    def doubled(self, hidden, out, forward):
        out.residual = out.residual + out.residual
        return real(self, hidden, out, forward)

    monkeypatch.setattr(branch.BranchAdapter, "merge_branch", doubled)
    assert not torch.equal(run_branch_rank(Parallel.single(), dp_segments), right)


def _layer_with_stream(parallel=None):
    parallel = parallel or Parallel.single()
    model = BranchStack(parallel, 1)
    fwd = Forward(parallel, 3, dp_counts=(3,) * parallel.topology.attn_dp)
    residual_batch.start(fwd)
    layer = model.layers[0]
    x = inputs_of([[3]])[0]
    h = layer.attn0_b.finish(layer.attn0.compute(layer.attn0_b.prepare(x, fwd), [3]), fwd)
    return layer, fwd, layer.moe_b.prepare(h, fwd)


def test_prepare_on_a_prepared_branch_is_rejected():
    layer, fwd, x = _layer_with_stream()
    with pytest.raises(RuntimeError) as info:
        layer.ffn0_b.prepare(x, fwd)
    assert str(info.value) == CoreMessages.BRANCH_PREPARE == "a prepared branch must enter through branch_input, not prepare"


@requires_plugins("cp")  # a CP stage needs the cp plugin to be built at all
def test_branch_transport_with_context_parallel_is_rejected_at_construction():
    parallel = ThreadWorld(4).parallel(Topology(tp=4, attn_cp=2), 0)
    (moe,) = make_stages((declare_ffn(sparse=True), RMSNorm(4)), terminal=True, parallel=parallel)
    with pytest.raises(NotImplementedError) as info:
        make_stages((declare_ffn(), RMSNorm(4)), prepared_from=moe.declaration, parallel=parallel)
    assert str(info.value) == "prepared branch transport requires ordinary token rows"


def test_a_branch_names_a_built_stage_of_its_own_stack():
    parallel = Parallel.single()
    with pytest.raises(ValueError, match=r"prepared_from=ffn\[sparse\] is a new declaration, not a built stage's"):
        make_stages((declare_ffn(), RMSNorm(4)), prepared_from=declare_ffn(sparse=True), parallel=parallel)
    with layer_stack(parallel, reduction="ar"):
        (elsewhere,) = make_stages((declare_ffn(sparse=True), RMSNorm(4)), terminal=True, label="other")
    with layer_stack(parallel, reduction="ar"):
        (moe,) = make_stages((declare_ffn(sparse=True), RMSNorm(4)), terminal=True)
        with pytest.raises(ValueError, match="names stage other, which was not built in this layer stack"):
            make_stages((declare_ffn(), RMSNorm(4)), prepared_from=elsewhere.declaration)
        make_stages((declare_ffn(), RMSNorm(4)), prepared_from=moe.declaration)  # its own stack's stage


def test_a_sequence_parallel_batch_has_no_branch_path():
    def fn(parallel):
        layer, _, _ = _layer_with_stream(parallel)
        fwd = Forward(parallel, 4, sequence_parallel=True)
        residual_batch.start(fwd)
        with pytest.raises(NotImplementedError) as info:
            branch_input(layer.ffn0_b, torch.zeros(4, 16, dtype=torch.float64), fwd)
        return str(info.value)

    # the table's message, and on a second line the reason construction recorded for the branch
    expected = "no stage boundary path for the active SEQUENCE_PARALLEL batch\nstage stages.0:ffn: " + (
        "prepared branch transport requires ordinary token rows")
    assert run_threaded(fn, Topology(tp=2)) == [expected] * 2


def test_branch_input_on_a_stage_with_a_previous_is_rejected():
    layer, fwd, x = _layer_with_stream()
    with pytest.raises(ValueError, match="is not a prepared branch .* enter it with prepare"):
        branch_input(layer.attn1_b, x, fwd)


def test_reading_the_main_line_before_the_merge_is_rejected():
    layer, fwd, x = _layer_with_stream()
    branch_input(layer.ffn0_b, x, fwd)
    with layer.moe_b.exit(fwd) as out:
        m = layer.moe.compute(x)
    m = out.finish(m)
    with pytest.raises(RuntimeError, match="moved into a prepared branch at stage .*merge_branch"):
        residual_batch.norm(m, fwd, RMSNorm(16, dtype=torch.float64))


def test_a_second_fork_and_a_foreign_merge_are_rejected():
    layer, fwd, x = _layer_with_stream()
    xb, bfwd = branch_input(layer.ffn0_b, x, fwd)
    with pytest.raises(RuntimeError, match="already moved into the branch"):
        branch_input(layer.ffn0_b, x, fwd)
    other_layer, other_fwd, other_x = _layer_with_stream()
    _, other_bfwd = branch_input(other_layer.ffn0_b, other_x, other_fwd)
    with layer.ffn0_b.exit(bfwd) as out:
        y = layer.ffn0.compute(xb)
    hb = out.finish(y)
    with layer.moe_b.exit(fwd) as out:
        m = layer.moe.compute(x)
    m = out.finish(m)
    branch = branch_output(hb, bfwd)
    with pytest.raises(RuntimeError, match="was not entered from this Forward"):
        merge_branch(m, branch, other_fwd)
    with pytest.raises(RuntimeError, match="no branch stream"):
        branch_output(hb, bfwd)  # released by the first call
    with pytest.raises(TypeError, match="takes the result of branch_output"):
        merge_branch(m, hb, fwd)


def test_missing_plugin_names_the_distribution_for_branches(monkeypatch, fresh_registry):
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "tbo")
    layer, fwd, x = _layer_with_stream()
    with pytest.raises(MissingPluginError) as info:
        branch_input(layer.ffn0_b, x, fwd)
    assert info.value.distribution == "layer-boundary-tbo"
    assert "prepared branches (branch_input) needs the layer-boundary-tbo distribution" in str(info.value)


class _Scaled:
    """A nonlinear update (residual * 0.5 + contribution): the merge cannot put it over the branch."""

    plain_add = False
    at_producer = False
    outlives_layer = True

    def apply(self, contribution, residual):
        return residual * 0.5 + contribution


def test_a_main_line_without_a_plain_add_cannot_branch():
    from layer_boundary import declare_attn

    parallel = Parallel.single()
    attn, moe = make_stages(
        (declare_attn(), RMSNorm(4, dtype=torch.float64)),
        (declare_ffn(update=_Scaled()), RMSNorm(4, dtype=torch.float64)),
        terminal=True,
        parallel=parallel,
    )
    (shortcut,) = make_stages((declare_ffn(), RMSNorm(4, dtype=torch.float64)), prepared_from=moe.declaration, parallel=parallel)
    fwd = Forward(parallel, 2)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(2, 4, dtype=torch.float64), fwd), fwd)
    x = moe.prepare(h, fwd)
    with pytest.raises(NotImplementedError, match="needs a plain-add update on the main line"):
        branch_input(shortcut, x, fwd)
