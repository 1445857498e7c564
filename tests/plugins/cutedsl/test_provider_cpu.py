"""The CuteDSLFusion provider inside the core's real boundary machinery, on CPU.

The kernels need a GPU, so these tests give the provider `testing.reference_kernels()` (the float64
references as a kernel set, any device): what is tested is the plumbing (which owed values a candidate takes,
the arguments it passes, the collective it runs, that it declines untouched otherwise).
"""

import pytest
import torch

from layer_boundary import MoeFinalizeHandoff
from layer_boundary import UnreducedOutput
from layer_boundary import Parallel, Topology
from layer_boundary import GemmaRMSNorm, RMSNorm
from layer_boundary.testing.grid import GridSpec, grid_inputs, reference, run_grid_rank
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_cutedsl.kernel_set import CUTEDSL_KERNELS, kernels_available
from layer_boundary_cutedsl.plugin import _factory
from layer_boundary_cutedsl.provider import CuteDSLFusion
from layer_boundary_cutedsl.testing import reference_kernels


class Calls(list):
    pass


@pytest.fixture
def fake_kernels():
    """Launches recorded here; the kernels are the float64 references (any device, fp64 norms)."""
    return Calls()


def _fusion(calls, **kw):
    return CuteDSLFusion(kernels=reference_kernels(calls), **kw)


class _Plan:
    def __init__(self, norm):
        self.norm = norm


def _candidates(norm, calls=None, fusion=None, **kw):
    fusion = fusion if fusion is not None else _fusion(calls, **kw)
    handoff, unreduced = fusion.attention_input(_Plan(norm))
    assert handoff.handoff and not unreduced.handoff and handoff.preserves_residual and unreduced.preserves_residual
    return handoff.run, unreduced.run


class _Group:
    def __init__(self, size, factor=1.0):
        self.size, self.factor, self.calls = size, factor, 0

    def all_reduce(self, x):
        self.calls += 1
        return x * self.factor


def _handoff(tokens=3, top_k=2, hidden=16, group=None, shared=False, dtype=torch.float64):
    gen = torch.Generator().manual_seed(tokens)
    rows = torch.randn(tokens, top_k, hidden, generator=gen).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen)
    sh = torch.randn(tokens, hidden, generator=gen).to(dtype) if shared else None
    return MoeFinalizeHandoff(rows, weights, torch.zeros(tokens, top_k, dtype=torch.long), sh, group, None)


def _names(calls):
    return [c[0] for c in calls]


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("shared", [False, True])
def test_handoff_over_one_rank_is_one_fused_call(fake_kernels, norm_cls, shared):
    norm = norm_cls(16, 1e-5, dtype=torch.float64)
    run, _ = _candidates(norm, fake_kernels)
    owed = _handoff(group=_Group(1), shared=shared)
    residual = torch.randn(3, 16, dtype=torch.float64)
    normed, new_residual = run(owed, residual, None)
    assert _names(fake_kernels) == ["moe_finalize_add_rmsnorm"]
    _, tokens, details = fake_kernels[0]
    assert tokens == 3 and details == {"eps": 1e-5, "weight_offset": norm.offset, "shared": shared}
    want_normed, want_residual = norm.add_forward(owed.finalize_local(), residual)
    assert torch.allclose(normed, want_normed) and torch.allclose(new_residual, want_residual)


def test_handoff_over_two_ranks_finalizes_reduces_then_norms(fake_kernels):
    norm = RMSNorm(16, 1e-6, dtype=torch.float64)
    run, _ = _candidates(norm, fake_kernels)
    group = _Group(2, factor=2.0)
    owed = _handoff(group=group, shared=True)
    residual = torch.randn(3, 16, dtype=torch.float64)
    normed, _ = run(owed, residual, None)
    assert _names(fake_kernels) == ["moe_finalize", "fused_add_rmsnorm"] and group.calls == 1
    want, _ = norm.add_forward(2.0 * owed.finalize_local(), residual)
    assert torch.allclose(normed, want)


def test_unreduced_output_is_reduced_then_fused(fake_kernels):
    norm = GemmaRMSNorm(16, 1e-6, dtype=torch.float64)
    _, run = _candidates(norm, fake_kernels)
    group = _Group(2, factor=3.0)
    partial = torch.randn(4, 16, dtype=torch.float64)
    residual = torch.randn(4, 16, dtype=torch.float64)
    normed, new_residual = run(UnreducedOutput(partial, group, None, declared=True), residual, None)
    assert _names(fake_kernels) == ["fused_add_rmsnorm"] and group.calls == 1
    want_normed, want_residual = norm.add_forward(3.0 * partial, residual)
    assert torch.allclose(normed, want_normed) and torch.allclose(new_residual, want_residual)


def _declines(run, owed, residual):
    tensors = residual if isinstance(residual, tuple) else (residual,)
    before = [t._version for t in tensors]
    assert run(owed, residual, None) is None
    assert [t._version for t in tensors] == before


def test_candidates_decline_what_the_kernels_cannot_do(fake_kernels):
    norm = RMSNorm(16, 1e-6, dtype=torch.float64)
    handoff_run, unreduced_run = _candidates(norm, fake_kernels)
    residual = torch.randn(3, 16, dtype=torch.float64)
    group = _Group(2)
    _declines(handoff_run, UnreducedOutput(residual.clone(), group, None, declared=True), residual)  # wrong kind
    _declines(unreduced_run, _handoff(), residual)
    _declines(unreduced_run, UnreducedOutput(torch.randn(3, 8, dtype=torch.float64), group, None, declared=True), residual)  # shape
    _declines(handoff_run, _handoff(top_k=17), residual)  # top_k too large
    _declines(handoff_run, _handoff(dtype=torch.float32), residual)  # rows and residual differ
    _declines(handoff_run, _handoff(), (residual, residual))  # a residual tuple (other residual kinds)
    _declines(handoff_run, _handoff(tokens=3, hidden=12), torch.randn(3, 12, dtype=torch.float64))  # width % 8
    _declines(handoff_run, _handoff(), torch.randn(3, 32, dtype=torch.float64)[:, ::2])  # not rows back to back
    _declines(_candidates(torch.nn.LayerNorm(16), fake_kernels)[0], _handoff(), residual)
    assert fake_kernels == [] and group.calls == 0


def test_the_cutedsl_kernels_decline_cpu_tensors_and_fp64_statistics():
    """With the real kernel set: CPU tensors and a norm computing in float64 are not theirs."""
    norm = RMSNorm(16, 1e-6, dtype=torch.bfloat16)
    handoff_run, unreduced_run = _candidates(norm, fusion=CuteDSLFusion())
    residual = torch.randn(3, 16).to(torch.bfloat16)
    _declines(handoff_run, _handoff(dtype=torch.bfloat16, group=_Group(1)), residual)
    _declines(unreduced_run, UnreducedOutput(residual.clone(), _Group(2), None, declared=True), residual)
    fp64 = RMSNorm(16, 1e-6, dtype=torch.float64, compute_dtype=torch.float64)
    from layer_boundary_cutedsl.fused_paths import norm_args

    assert norm_args(CUTEDSL_KERNELS, fp64, torch.randn(3, 16, dtype=torch.float64)) is None


def test_without_gpu_nothing_defers():
    kernels_available.cache_clear()
    if kernels_available():
        pytest.skip("a GPU is visible")
    from layer_boundary import Forward

    fwd = Forward(Parallel.single(), 4)
    plan = type("Plan", (), {"terminal": False})()
    fusion = CuteDSLFusion(defer_finalize=True)
    assert not fusion.can_defer_finalize(plan, fwd) and not fusion.can_defer_all_reduce(plan, fwd)


def test_registry_factory_is_opt_in(monkeypatch):
    monkeypatch.delenv("LAYER_BOUNDARY_CUTEDSL", raising=False)
    assert _factory(None) is None
    monkeypatch.setenv("LAYER_BOUNDARY_CUTEDSL", "1")
    assert isinstance(_factory(None), CuteDSLFusion)


MOE_SPEC = GridSpec(stages=("attn", "moe", "attn", "moe", "attn", "ffn"), hidden=16, top_k=2, experts=4)


@pytest.mark.parametrize("tp", [1, 2])
def test_in_a_model_the_handoff_reaches_the_candidate(fake_kernels, tp):
    """A grid model whose MoE stages defer their finalize (an uninstalled provider with
    defer_finalize=True): the next input's candidate takes the handoff (over TP ranks: finalize,
    all-reduce, add + norm) and the outputs match the single-rank reference."""
    dp_counts = [5]
    want, _ = reference(MOE_SPEC, grid_inputs(MOE_SPEC, dp_counts))
    fusion = _fusion(fake_kernels, defer_finalize=True)
    if tp == 1:
        got = [run_grid_rank(Parallel.single(), MOE_SPEC, dp_counts, fusions=fusion)[0]]
    else:
        got = [r[0] for r in run_threaded(lambda p: run_grid_rank(p, MOE_SPEC, dp_counts, fusions=fusion), Topology(tp=tp))]
    names = _names(fake_kernels)
    expected = "moe_finalize_add_rmsnorm" if tp == 1 else "moe_finalize"
    assert names.count(expected) == 2 * tp  # both MoE stages, on every rank
    if tp == 2:
        # every owed sum went through a candidate: 3 attention sums and 2 MoE sums per rank
        assert names.count("fused_add_rmsnorm") == 5 * tp
    for out in got:
        assert torch.allclose(out, want[0], rtol=1e-9, atol=1e-9)
