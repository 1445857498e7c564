"""Fusion providers: order, the None rule, errors, handoffs, and the terminal finalize."""

import pytest
import torch

from layer_boundary import (
    CollectiveCounter,
    CountingCollectives,
    Forward,
    FusedMlpInput,
    FusionError,
    FusionProvider,
    RMSNorm,
    SumGroup,
    Topology,
    declare_attn,
    declare_ffn,
    hookimpl,
    make_stages,
    residual_batch,
)
from layer_boundary import _debug as debug_module
from layer_boundary import _fusions as fusions_module
from layer_boundary.plugin import add_rms_norm
from layer_boundary.testing.grid import GridSpec, run_grid_rank
from layer_boundary.testing.threaded import run_threaded

from grid_cases import assert_matches_reference

H = 4


def _norm():
    return RMSNorm(H, dtype=torch.float64, compute_dtype=torch.float64)


class Declining:
    """A provider whose candidate always declines (and records that it was asked)."""

    def __init__(self, log, name="declining"):
        self.log, self.name = log, name

    def attention_input(self, plan):
        return (FusedMlpInput(run=self.run, name=self.name, completes=SumGroup.TP),)

    ffn_input = attention_input

    def run(self, owed, residual, fwd):
        self.log.append(self.name)
        return None


class Accepting:
    """Completes the sum itself (one all-reduce) and adds + norms: a stand-in fused kernel."""

    def __init__(self, log, name="accepting"):
        self.log, self.name = log, name

    def attention_input(self, plan):
        norm = plan.norm
        return (FusedMlpInput(run=lambda owed, r, fwd: self._run(norm, owed, r), name=self.name, completes=SumGroup.ATTN_TP),)

    ffn_input = attention_input

    def _run(self, norm, owed, residual):
        self.log.append(self.name)
        return add_rms_norm(norm, owed.group.all_reduce(owed.partial), residual)


def _layer_run(parallel, fusions=None, counter=None):
    if counter is not None:
        parallel = parallel.with_groups(lambda g: CountingCollectives(g, counter))
    opts = {"fusions": fusions} if fusions is not None else {}
    attn, ffn, attn2 = make_stages(
        (declare_attn(), _norm(), opts), (declare_ffn(), _norm(), opts), (declare_attn(), _norm(), opts),
        terminal=True, parallel=parallel,
    )
    fwd = Forward(parallel, 3)
    residual_batch.start(fwd)
    x = torch.arange(3 * H, dtype=torch.float64).reshape(3, H) / 8
    h = attn.finish(attn.prepare(x, fwd) * 0.5, fwd)
    y = ffn.prepare(h, fwd)
    with ffn.exit(fwd) as out:
        y = y * 0.25
    h = out.finish(y)
    h = attn2.finish(attn2.prepare(h, fwd), fwd)
    return residual_batch.norm(h, fwd, _norm())


def test_a_declining_candidate_never_runs_a_collective():
    plain, with_decliner, log = CollectiveCounter(), CollectiveCounter(), []
    a = run_threaded(lambda p: _layer_run(p, counter=plain), Topology(tp=2))
    b = run_threaded(lambda p: _layer_run(p, fusions=Declining(log), counter=with_decliner), Topology(tp=2))
    assert log.count("declining") == 4  # asked at both inputs on both ranks
    assert with_decliner.calls == plain.calls
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_an_accepting_candidate_replaces_the_unfused_path():
    log = []
    a = run_threaded(_layer_run, Topology(tp=2))
    b = run_threaded(lambda p: _layer_run(p, fusions=Accepting(log)), Topology(tp=2))
    assert log.count("accepting") == 4
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_explicit_fusions_come_before_registry_providers(inline_plugin, fresh_registry):
    log = []

    class RegistryPlugin:
        @hookimpl
        def layer_boundary_fusion_providers(self):
            yield FusionProvider(name="test.low", factory=lambda s: Declining(log, "registry-low"), priority=1)
            yield FusionProvider(name="test.high", factory=lambda s: Declining(log, "registry-high"), priority=50)
            yield FusionProvider(name="test.skip", factory=lambda s: None, priority=99)

    inline_plugin(RegistryPlugin(), name="test-providers")
    run_threaded(lambda p: _layer_run(p, fusions=Declining(log, "explicit")), Topology(tp=2))
    assert log[:3] == ["explicit", "registry-high", "registry-low"]
    plan_names = None

    def names(parallel):
        (attn, ffn) = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), parallel=parallel, terminal=True)
        return [c.name for c in ffn.plan.paths[next(iter(ffn.plan.paths))].entry.candidates]

    plan_names = run_threaded(names, Topology(tp=2))[0]
    mine = [n for n in plan_names if n.startswith("registry-") or n == "core.unfused"]
    assert mine == ["registry-high", "registry-low", "core.unfused"] and plan_names[-1] == "core.unfused"


def test_a_raising_candidate_names_its_plugin_and_record(inline_plugin, fresh_registry):
    class Boom:
        def ffn_input(self, plan):
            def run(owed, residual, fwd):
                raise RuntimeError("kernel launch failed")

            return (FusedMlpInput(run=run, name="boom.kernel"),)

    class Plugin:
        @hookimpl
        def layer_boundary_fusion_providers(self):
            yield FusionProvider(name="boom.provider", factory=lambda s: Boom(), priority=10)

    inline_plugin(Plugin(), name="boom")
    with pytest.raises(FusionError, match="'boom.kernel' from record 'boom.provider' of plugin 'boom'.*kernel launch failed"):
        run_threaded(_layer_run, Topology(tp=2))


def test_debug_mode_catches_a_candidate_that_declines_after_touching_its_input(monkeypatch):
    class Sloppy:
        def ffn_input(self, plan):
            def run(owed, residual, fwd):
                owed.partial.mul_(1.0)  # touches the input, then declines
                return None

            return (FusedMlpInput(run=run, name="sloppy"),)

    monkeypatch.setattr(debug_module, "DEBUG", True)
    with pytest.raises(FusionError, match="declined after modifying its inputs"):
        run_threaded(lambda p: _layer_run(p, fusions=Sloppy()), Topology(tp=2))


def test_candidates_are_offered_only_for_plain_update_and_plain_norm():
    class HalfUpdate:
        plain_add, at_producer, outlives_layer = False, False, True

        def apply(self, c, r):
            return (c + r) * 0.5

    def fn(parallel):
        attn, ffn = make_stages(
            (declare_attn(update=HalfUpdate()), _norm(), {"fusions": Accepting([])}), (declare_ffn(), _norm(), {"fusions": Accepting([])}),
            terminal=True, parallel=parallel,
        )
        ordinary = next(iter(ffn.plan.paths.values()))
        return len(ordinary.entry.candidates)

    assert run_threaded(fn, Topology(tp=2)) == [0, 0]


class TorchFinalizeService:
    """A reference `handoff_norm` service and provider: defers MoE finalize (terminal too) and
    finalizes + sums + adds + norms in torch, with the grid norm's exact op order."""

    def __init__(self, eps=1e-6):
        self.eps = eps
        self.calls = []

    def can_defer_finalize(self, plan, fwd):
        return plan.description.sparse

    def attention_input(self, plan):
        norm = plan.norm
        return (FusedMlpInput(run=lambda owed, r, fwd: self._take(norm, owed, r), handoff=True, name="torch.finalize"),)

    def _take(self, norm, handoff, residual):
        self.calls.append("layer")
        return add_rms_norm(norm, handoff.complete(), residual)

    def finalize(self, handoff, residual, gamma):
        self.calls.append("terminal")
        total = handoff.complete() + residual
        normalized = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + self.eps)
        return gamma * normalized, total


@pytest.mark.parametrize("topo, counts", [(Topology(tp=2), (5,)), (Topology(tp=4, moe_ep=2), (4,)), (Topology(tp=1), (3,))])
def test_moe_finalize_handoff_including_the_terminal_final_norm(topo, counts):
    spec = GridSpec(stages=("attn", "moe", "attn", "moe"), seed=11)
    services = []

    def fn(parallel):
        service = TorchFinalizeService()
        services.append(service)
        return run_grid_rank(parallel, spec, counts, fusions=service, handoff_norm=service)

    results = run_threaded(fn, topo)
    assert_matches_reference(results, spec, topo, counts)
    for service in services:
        assert service.calls == ["layer", "terminal"]


def test_group_equivalence_lets_a_tp_candidate_take_an_attention_tp_sum():
    def fn(parallel):
        (attn, ffn) = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm(), {"fusions": Declining([])}), parallel=parallel, terminal=True)
        cand = next(iter(ffn.plan.paths.values())).entry.candidates[0]
        return SumGroup.ATTN_TP in cand.accepts

    assert run_threaded(fn, Topology(tp=2)) == [True, True]
    groups = fusions_module._equivalent_groups(Topology(tp=4, attn_dp=2))
    assert SumGroup.ATTN_TP not in groups[SumGroup.TP] and SumGroup.MOE_OUTPUT in groups[SumGroup.TP]
