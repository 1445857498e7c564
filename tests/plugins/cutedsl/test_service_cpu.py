"""install_cutedsl_fusion / prepare_cutedsl_fusion and the service, on CPU ranks.

A grid model (core/layer_boundary/testing/grid.py: exact float64 arithmetic, norms computing in
float64) with `CuteDSLFusion(kernels=reference_kernels(...))` on every stage; its outputs are
compared with the single-rank unfused reference.
"""

import pytest
import torch

from layer_boundary import Forward
from layer_boundary import Parallel, Topology
from layer_boundary import residual_batch
from layer_boundary import GemmaRMSNorm
from layer_boundary.testing.grid import GridModel, GridSpec, grid_inputs, reference
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_cutedsl import CuteDSLFusion, CuteDSLService, install_cutedsl_fusion, prepare_cutedsl_fusion
from layer_boundary_cutedsl.kernel_set import MoeShape
from layer_boundary_cutedsl.testing import reference_kernels

#: ends in a MoE: its finalize is the terminal one
SPEC = GridSpec(stages=("attn", "moe", "attn", "ffn", "attn", "moe"), hidden=16, top_k=2, experts=4)
TOKENS = 5


def _model(parallel, calls, spec=SPEC, **kw):
    fusion = CuteDSLFusion(kernels=reference_kernels(calls), **kw)
    return GridModel(spec, parallel, fusions=fusion), fusion


def _run(model, fwd, x, *, handoff_norm=None, capture=None):
    """GridModel.run, with the final norm's capture_output exposed."""
    residual_batch.start(fwd)
    h = x
    for stage, boundary in zip(model.stages, model.boundaries):
        inp = boundary.prepare(h, fwd)
        if stage.code == "attn":
            h = boundary.finish(stage.compute(inp), fwd)
        else:
            with boundary.exit(fwd) as out:
                y = stage.compute(inp)
            h = out.finish(y)
    return residual_batch.norm(h, fwd, model.final_norm, handoff_norm=handoff_norm, capture_output=capture)


def _names(calls):
    return [c[0] for c in calls if c[0] != "prepare"]


def _want(n=TOKENS, spec=SPEC):
    return reference(spec, grid_inputs(spec, [n]))[0][0]


# ------------------------------------------------------------------------------------------ install


def test_one_service_for_every_stage():
    model, fusion = _model(Parallel.single(), [])
    service = install_cutedsl_fusion(model, terminal_finalize=True, final_norm=model.final_norm)
    assert isinstance(service, CuteDSLService) and fusion.service is service
    assert service.hidden_size == 16 and service.rms_epsilon == 1e-6 and service.group.size == 1
    assert service.max_tokens is None and not service.supports(1)  # nothing defers before prepare
    assert "not prepared" in repr(service) and "float64-reference" in repr(fusion)


def test_separate_providers_per_stage_share_the_service():
    calls = []
    kernels = reference_kernels(calls)

    class PerStage(list):
        pass

    made = PerStage()

    def factory():
        f = CuteDSLFusion(kernels=kernels)
        made.append(f)
        return f

    model = GridModel(SPEC, Parallel.single())  # no provider: error
    with pytest.raises(ValueError, match="no stage of model has a CuteDSLFusion provider; build the stages with fusions=CuteDSLFusion"):
        install_cutedsl_fusion(model)
    # two models' worth of stages, one provider each, installed as one list of layers
    a = GridModel(SPEC, Parallel.single(), fusions=factory())
    b = GridModel(SPEC, Parallel.single(), fusions=factory())
    service = install_cutedsl_fusion([a, b], final_norm=a.final_norm, terminal_finalize=True)
    assert all(f.service is service for f in made)


def test_epsilon_consistency_is_checked_before_anything_changes():
    model, fusion = _model(Parallel.single(), [])
    model.stages[2].norm.eps = 1e-5
    with pytest.raises(ValueError, match=r"model: the CuTe DSL fusion compiles one workspace for rms_epsilon=1e-06, but a fused norm uses 1e-05 \(stage stage2\)"):
        install_cutedsl_fusion(model)
    assert fusion.service is None
    model.stages[2].norm.eps = 1e-6
    with pytest.raises(ValueError, match=r"rms_epsilon=1e-05, but a fused norm uses 1e-06 \(stage stage0\)"):
        install_cutedsl_fusion(model, rms_epsilon=1e-5)
    other = GemmaRMSNorm(16, 1e-5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"but a fused norm uses 1e-05 \(the final norm\)"):
        install_cutedsl_fusion(model, terminal_finalize=True, final_norm=other)
    with pytest.raises(ValueError, match="the final norm, a core RMSNorm/GemmaRMSNorm"):
        install_cutedsl_fusion(model, terminal_finalize=True, final_norm=torch.nn.LayerNorm(16))
    assert fusion.service is None


def test_terminal_finalize_needs_a_terminal_moe_and_install_happens_once():
    dense_end = GridSpec(stages=("attn", "moe", "attn", "ffn"), hidden=16, top_k=2, experts=4)
    model, _ = _model(Parallel.single(), [], spec=dense_end)
    with pytest.raises(ValueError, match="is not a MoE FFN with a CuteDSLFusion provider"):
        install_cutedsl_fusion(model, terminal_finalize=True, final_norm=model.final_norm)
    install_cutedsl_fusion(model)
    with pytest.raises(RuntimeError, match="is already installed; a model has one service"):
        install_cutedsl_fusion(model)


# ------------------------------------------------------------------------------------------ prepare


def test_prepare_sizes_one_workspace_once():
    calls = []
    model, _ = _model(Parallel.single(), calls)
    with pytest.raises(RuntimeError, match="no CuTe DSL service is installed on this model; call install_cutedsl_fusion"):
        prepare_cutedsl_fusion(model, max_tokens=8)
    service = install_cutedsl_fusion(model, top_k=2, shared_expert=False)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens must be a positive int"):
            prepare_cutedsl_fusion(model, max_tokens=bad)
    assert prepare_cutedsl_fusion(model, max_tokens=8) == [service]
    prepares = [c for c in calls if c[0] == "prepare"]
    assert len(prepares) == 1 and prepares[0][2]["moe"] == (MoeShape(2, False, True, 0.0),) and prepares[0][2]["hidden"] == 16
    assert service.supports(8) and not service.supports(9) and not service.supports(0)
    prepare_cutedsl_fusion(model, max_tokens=4)  # smaller: the workspace already holds it
    with pytest.raises(RuntimeError, match="was prepared for max_tokens=8; preparing again with 16"):
        prepare_cutedsl_fusion(model, max_tokens=16)
    assert len([c for c in calls if c[0] == "prepare"]) == 1


def test_before_prepare_nothing_defers_and_the_output_is_right():
    calls = []
    model, _ = _model(Parallel.single(), calls)
    install_cutedsl_fusion(model, terminal_finalize=True, final_norm=model.final_norm)
    out = _run(model, Forward(Parallel.single(), TOKENS), grid_inputs(SPEC, [TOKENS])[0])
    assert "moe_finalize_add_rmsnorm" not in _names(calls)
    assert torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_terminal_finalize_through_the_service(tp):
    """Both MoE stages hand off: the first to the next input's candidate, the last to the final
    norm's `service.finalize`; outputs match the single-rank unfused reference at TP 1 and 2."""
    calls = {}
    x = grid_inputs(SPEC, [TOKENS])[0]

    def rank(parallel):
        mine = calls.setdefault(parallel.rank, [])
        model, _ = _model(parallel, mine)
        service = install_cutedsl_fusion(model, terminal_finalize=True, final_norm=model.final_norm)
        prepare_cutedsl_fusion(model, max_tokens=8)
        with torch.inference_mode():
            return _run(model, Forward(parallel, TOKENS), x, handoff_norm=service)

    outs = [rank(Parallel.single())] if tp == 1 else run_threaded(rank, Topology(tp=tp))
    for out in outs:
        assert torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)
    names = [_names(calls[r]) for r in sorted(calls)]
    assert all(n == names[0] for n in names)
    if tp == 1:
        assert names[0].count("moe_finalize_add_rmsnorm") == 2
    else:
        assert names[0].count("moe_finalize") == 2
        buffered = [c[2]["into_buffer"] for c in calls[0] if c[0] == "moe_finalize"]
        assert buffered == [True, True]  # the service's workspace held the partials
    last = [c for c in calls[0] if c[0] != "prepare"][-1]
    assert last[2]["weight_offset"] == 0.0 and last[2]["eps"] == 1e-6


def test_can_defer_finalize_picks_the_stages():
    calls = []
    model, _ = _model(Parallel.single(), calls)
    install_cutedsl_fusion(model, can_defer_finalize=lambda b: b.plan.label == "stage5", terminal_finalize=True, final_norm=model.final_norm)
    prepare_cutedsl_fusion(model, max_tokens=8)
    service = model.boundaries[0].fusions.service
    with torch.inference_mode():
        out = _run(model, Forward(Parallel.single(), TOKENS), grid_inputs(SPEC, [TOKENS])[0], handoff_norm=service)
    assert _names(calls).count("moe_finalize_add_rmsnorm") == 1  # only the terminal one
    assert torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)


def test_capture_at_a_fused_final_norm_is_rejected():
    model, _ = _model(Parallel.single(), [])
    service = install_cutedsl_fusion(model, terminal_finalize=True, final_norm=model.final_norm)
    prepare_cutedsl_fusion(model, max_tokens=8)
    x = grid_inputs(SPEC, [TOKENS])[0]
    with pytest.raises(RuntimeError, match="capture_output needs the unfused path: drop handoff_norm or capture elsewhere"):
        _run(model, Forward(Parallel.single(), TOKENS), x, handoff_norm=service, capture=lambda v, owned=False: None)
    # without handoff_norm the handoff completes unfused and the capture sees the new residual
    captured = []
    out = _run(model, Forward(Parallel.single(), TOKENS), x, capture=lambda v, owned=False: captured.append(v.clone()))
    assert len(captured) == 1 and torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)


def test_the_service_finishes_what_its_kernels_cannot_take():
    """finalize() never declines: rows the kernels cannot read go through torch code with the
    same semantics and the same single all-reduce."""
    from layer_boundary import MoeFinalizeHandoff

    calls = []
    model, _ = _model(Parallel.single(), calls)
    service = install_cutedsl_fusion(model)

    class Twice:
        size, calls = 2, 0

        def all_reduce(self, x):
            Twice.calls += 1
            return 2 * x

    rows = torch.randn(3, 2, 16, dtype=torch.float64)
    weights = torch.rand(3, 2, dtype=torch.float64)
    strided = torch.randn(3, 32, dtype=torch.float64)[:, ::2]  # not rows back to back
    handoff = MoeFinalizeHandoff(rows, weights, None, None, Twice(), None)
    gamma = torch.rand(16, dtype=torch.float64) + 0.5
    normed, new_residual = service.finalize(handoff, strided, gamma)
    assert Twice.calls == 1 and _names(calls) == []
    total = 2 * (rows * weights[..., None]).sum(1) + strided
    assert torch.allclose(new_residual, total)
    assert torch.allclose(normed, total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma)


# ------------------------------------------------------------------------------------------ decisions


def test_one_rank_without_kernels_turns_deferral_off_everywhere():
    """prepare() votes over the TP group: rank 1 cannot run the kernels, so neither rank defers
    (the unfused path runs, same collectives on both), and the output is still right."""
    usable = {}
    x = grid_inputs(SPEC, [TOKENS])[0]

    def rank(parallel):
        kernels = reference_kernels()
        if parallel.rank == 1:
            from dataclasses import replace

            kernels = replace(kernels, available=lambda: False)
        model = GridModel(SPEC, parallel, fusions=CuteDSLFusion(kernels=kernels))
        service = install_cutedsl_fusion(model, terminal_finalize=True, final_norm=model.final_norm)
        prepare_cutedsl_fusion(model, max_tokens=8)
        usable[parallel.rank] = service.usable
        with torch.inference_mode():
            return _run(model, Forward(parallel, TOKENS), x, handoff_norm=service)

    for out in run_threaded(rank, Topology(tp=2)):
        assert torch.allclose(out, _want(), rtol=1e-12, atol=1e-12)
    assert usable == {0: False, 1: False}


def test_a_rank_whose_prepare_fails_votes_first_then_raises():
    usable = {}

    def rank(parallel):
        kernels = reference_kernels()
        if parallel.rank == 1:
            from dataclasses import replace

            def broken(*args):
                raise OSError("cubin failed to load")

            kernels = replace(kernels, prepare=broken)
        model = GridModel(SPEC, parallel, fusions=CuteDSLFusion(kernels=kernels))
        service = install_cutedsl_fusion(model)
        try:
            prepare_cutedsl_fusion(model, max_tokens=8)
        finally:
            usable[parallel.rank] = service.usable

    with pytest.raises(Exception, match="could not prepare its kernels: OSError: cubin failed to load"):
        run_threaded(rank, Topology(tp=2))
    assert usable == {0: False, 1: False}


def test_batch_facts_that_turn_deferral_off():
    model, fusion = _model(Parallel.single(), [])
    install_cutedsl_fusion(model)
    prepare_cutedsl_fusion(model, max_tokens=8)
    moe = model.boundaries[1].plan
    assert fusion.can_defer_finalize(moe, Forward(Parallel.single(), 8))
    assert not fusion.can_defer_finalize(moe, Forward(Parallel.single(), 9))  # beyond the workspace
    assert not fusion.can_defer_finalize(moe, Forward(Parallel.single(), 0))
    assert not fusion.can_defer_finalize(model.boundaries[3].plan, Forward(Parallel.single(), 4))  # dense FFN
    assert not fusion.can_defer_finalize(model.boundaries[5].plan, Forward(Parallel.single(), 4))  # terminal, not asked for
    assert fusion.can_defer_all_reduce(model.boundaries[3].plan, Forward(Parallel.single(), 4))

    class DP:  # an attention-DP batch: rows differ per rank, nothing is deferred
        num_tokens = 4
        variant = Forward(Parallel.single(), 4).variant
        parallel = type("P", (), {"topology": Topology(tp=2, attn_dp=2)})()

    assert not fusion.can_defer_finalize(moe, DP()) and not fusion.can_defer_all_reduce(moe, DP())


# ------------------------------------------------------------------------------------------ gloo


def _gloo_rank(parallel):
    calls = []
    model, _ = _model(parallel, calls)
    service = install_cutedsl_fusion(model, terminal_finalize=True, final_norm=model.final_norm)
    prepare_cutedsl_fusion(model, max_tokens=8)
    with torch.inference_mode():
        out = _run(model, Forward(parallel, TOKENS), grid_inputs(SPEC, [TOKENS])[0], handoff_norm=service)
    return out, service.usable, _names(calls)


def test_terminal_finalize_under_gloo(gloo_world):
    """The service's collectives (the prepare vote, finalize -> all-reduce -> add + norm at every
    boundary and at the final norm) over real gloo process groups, TP=2."""
    results = gloo_world(2).run(_gloo_rank, Topology(tp=2))
    want = _want()
    for out, usable, names in results:
        assert usable and torch.allclose(out, want, rtol=1e-12, atol=1e-12)
        assert names == results[0][2] and names.count("moe_finalize") == 2
