"""The candidates inside real models (threaded TP=2, float32, the reference backend standing in
for the kernels): same logits with the plugin on and off, the fused path taken exactly where
it should be, declines that touch nothing, MoE finalize handoffs, and prepare's re-runs."""


import attrs
import pytest
import torch

from flashinfer_fakes import ReferenceBackend, hardware_present, model_logits, on_off_run, prompt_batches, tiny_model
from layer_boundary import CollectiveCounter, CountingCollectives, Forward, Parallel, Topology, UnreducedOutput
from layer_boundary import MoeFinalizeHandoff
from layer_boundary import SumGroup
from layer_boundary import boundaries_of
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer.provider import AllReduceAddNorm, FinalizeAddNorm, FlashInferFinalizeFusion, FlashInferFusion
from layer_boundary_flashinfer.service import prepare_flashinfer_fusion
from layer_boundary_flashinfer.workspace import WorkspaceManager

TP2 = Topology(tp=2)
# tiny models: 3 layers; prefill 9 tokens (3 requests), then a 3-token decode step


@pytest.mark.parametrize("name,all_reduce,finalize", [("qwen3", 10, 0), ("gemma", 10, 0), ("qwen3_moe", 8, 2)])
def test_plugin_on_and_off_give_the_same_logits(name, all_reduce, finalize):
    results = run_threaded(on_off_run, TP2, name, {}, timeout=60)
    for res in results:
        report = res["report"]
        # every input but the stack entry is fused: 2 per layer, less the first attention
        assert report.available and len(report.bound) == 5 and report.skipped == (("layer0.0:attention", "nothing is ever owed at this input"),)
        assert len(report.finalize) == (2 if name == "qwen3_moe" else 0)
        # qwen3_moe: the fake finalize kernel takes <= 4 tokens, so the 9-token prefill combines in
        # torch and uses the fused all-reduce; the 3-token decode uses the finalize kernel
        assert res["launches"] == {"all_reduce": all_reduce, "finalize": finalize}
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["fused"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["fused"], results[1]["fused"]))


def test_a_width_the_finalize_kernel_gets_wrong_keeps_the_finalize_in_the_moe():
    """qwen3_moe with the backend refusing its width (as FlashInfer's kernel rules refuse hidden 64
    or 2880): no handoff, no finalize launch, the MoE sums still meet the fused all-reduce."""
    refuse = {(32, torch.float32): "the finalize kernel's spare warp lanes would touch the next token"}
    for res in run_threaded(on_off_run, TP2, "qwen3_moe", {"finalize_declines": refuse}, timeout=60):
        report = res["report"]
        assert report.finalize == () and len(report.finalize_declined) == 2
        assert "MoE finalize(s) kept in the MoE: the finalize kernel's spare warp lanes" in str(report)
        assert res["launches"] == {"all_reduce": 10, "finalize": 0}
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["fused"]))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_batches_above_the_limit_take_the_unfused_path(name):
    for res in run_threaded(on_off_run, TP2, name, {}, 4, timeout=60):
        assert res["launches"] == ({"all_reduce": 5, "finalize": 0} if name == "qwen3" else {"all_reduce": 3, "finalize": 2})
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["fused"]))


class _Group:
    name, size, rank, device = "tp", 2, 0, "cpu"

    def __init__(self, ranks=(0, 1)):
        self.ranks = ranks


def _bound_all_reduce(limit=8, hidden=16, dtype=torch.float32):
    calls = []

    def launch(x, residual, tokens):
        calls.append((x, residual, tokens))
        return torch.zeros_like(residual), residual + 1

    cand = AllReduceAddNorm()
    group = _Group()
    cand.bind(launch, limit=limit, dtype=dtype, hidden=hidden, group=group, cuda=False)
    return cand, group, calls


def _owed(tokens, hidden=16, dtype=torch.float32, group=None):
    return UnreducedOutput(torch.randn(tokens, hidden).to(dtype), group or _Group(), SumGroup.TP, declared=False)


def test_the_all_reduce_candidate_declines_before_touching_anything():
    cand, group, calls = _bound_all_reduce()
    residual = torch.randn(3, 16)
    cases = [
        (_owed(3, group=group), residual.to(torch.bfloat16)),  # residual dtype
        (_owed(3, dtype=torch.bfloat16, group=group), residual),  # partial dtype
        (_owed(0, group=group), residual[:0]),  # no tokens
        (_owed(9, group=group), torch.randn(9, 16)),  # above the limit
        (_owed(3, hidden=8, group=group), torch.randn(3, 8)),  # another width
        (_owed(3, group=_Group((0, 2))), residual),  # a sum over other ranks
        (_owed(3, group=group), (residual, residual)),  # a residual that is not one tensor
        (_owed(2, group=group), residual),  # shapes disagree
    ]
    for owed, res in cases:
        partial = owed.partial
        before = (partial.clone(), partial._version)
        assert cand(owed, res, None) is None
        assert torch.equal(partial, before[0]) and partial._version == before[1] and owed.partial is partial
    assert calls == []
    cand.unbind()
    assert cand(_owed(3, group=group), residual, None) is None and calls == []


def test_the_all_reduce_candidate_hands_the_launcher_aligned_contiguous_rows():
    cand, group, calls = _bound_all_reduce()
    wide = torch.randn(3, 32)
    partial = wide[:, ::2]  # strided
    residual = torch.randn(49)[1:].view(3, 16)  # contiguous, 4 bytes past an aligned start
    out = cand(UnreducedOutput(partial, group, SumGroup.TP, declared=True), residual, None)
    (x, r, tokens), = calls
    assert tokens == 3 and x.is_contiguous() and torch.equal(x, partial) and torch.equal(r, residual)
    assert x.data_ptr() % 16 == 0 and r.data_ptr() % 16 == 0
    assert torch.equal(out[1], residual + 1)
    aligned = torch.randn(3, 16)
    cand(UnreducedOutput(aligned, group, SumGroup.TP, declared=True), aligned, None)
    assert calls[-1][0] is aligned  # nothing copied when nothing needs it


def _handoff(tokens, top_k=2, hidden=16, group=None, shared=True):
    rows = torch.randn(tokens, top_k, hidden)
    weights = torch.rand(tokens, top_k, dtype=torch.float64)
    return MoeFinalizeHandoff(rows, weights, torch.zeros(tokens, top_k, dtype=torch.long), torch.randn(tokens, hidden) if shared else None,
                              group or _Group(), SumGroup.MOE_OUTPUT)


def test_the_finalize_candidate_uses_the_kernel_up_to_its_limit_and_torch_combine_above():
    ar, group, ar_calls = _bound_all_reduce(limit=64)
    fin_calls = []

    def launch(rows, scales, shared, residual):
        fin_calls.append((rows, scales, shared, residual))
        return torch.zeros_like(residual), residual

    launch.max_tokens, launch.max_top_k = 4, 2
    cand = FinalizeAddNorm(ar)
    cand.bind(launch, limit=64, dtype=torch.float32, hidden=16, group=group, cuda=False)
    small = _handoff(3, group=group)
    cand(small, torch.randn(3, 16), None)
    rows, scales, shared, _ = fin_calls[0]
    assert rows is small.expert_rows and scales.dtype == torch.float32 and torch.equal(scales, small.weights.float())
    assert shared is small.shared and ar_calls == []
    large = _handoff(5, group=group)
    cand(large, torch.randn(5, 16), None)
    assert len(fin_calls) == 1 and torch.equal(ar_calls[0][0], large.finalize_local())
    wide_k = _handoff(2, top_k=3, group=group)  # more experts than the kernel's index map
    cand(wide_k, torch.randn(2, 16), None)
    assert len(fin_calls) == 1 and len(ar_calls) == 2
    for owed, res in [(_handoff(3, group=_Group((1, 2))), torch.randn(3, 16)), (_handoff(0, group=group), torch.randn(0, 16)),
                      (_handoff(3, hidden=8, group=group), torch.randn(3, 8)), (_owed(3, group=group), torch.randn(3, 16))]:
        assert cand(owed, res, None) is None
    assert len(fin_calls) == 1 and len(ar_calls) == 2


def _moe_deferral(parallel):
    backend = ReferenceBackend()
    manager = WorkspaceManager(backend)
    with hardware_present():
        _, model = tiny_model("qwen3_moe", parallel)
    producers = [p for b in boundaries_of(model) for p, _ in b.plan.providers if isinstance(p, FlashInferFinalizeFusion)]
    plan = next(b.plan for b in boundaries_of(model) if any(p is producers[0] for p, _ in b.plan.providers))

    def asks():
        return [producers[0].can_defer_finalize(plan, Forward(parallel, n)) for n in (0, 1, 16, 17)]

    before = asks()
    prepare_flashinfer_fusion(model, max_tokens=16, manager=manager)
    during = asks()
    manager.shutdown()
    return len(producers), before, during, asks()


def test_moe_finalize_deferral_follows_the_agreed_workspace():
    for n, before, during, after in run_threaded(_moe_deferral, TP2, timeout=60):
        assert n == 2  # the two MoE FFNs before a layer (the third layer is dense and terminal)
        assert before == [False] * 4 and during == [False, True, True, False] and after == [False] * 4


def _prepare_twice(parallel):
    backend = ReferenceBackend()
    manager = WorkspaceManager(backend)
    with hardware_present():
        config, first = tiny_model("qwen3", parallel)
        _, second = tiny_model("qwen3", parallel)
    prompts = prompt_batches(config)
    reports = [prepare_flashinfer_fusion(first, max_tokens=16, manager=manager),
               prepare_flashinfer_fusion(second, max_tokens=16, manager=manager),
               prepare_flashinfer_fusion(first, max_tokens=16, manager=manager)]
    both_bound = [_all_bound(first), _all_bound(second)]
    reports.append(prepare_flashinfer_fusion(first, max_tokens=512, manager=manager))
    after_rebuild = [_all_bound(first), _all_bound(second)]
    model_logits(second, parallel, prompts)  # unbound: it runs unfused
    launches = len(backend.launches)
    manager.shutdown()
    return [r.groups[0].action for r in reports], both_bound, after_rebuild, launches


def _all_bound(model):
    providers = [p for b in boundaries_of(model) for p, _ in b.plan.providers if isinstance(p, FlashInferFusion)]
    return [p.bound for p in providers if p.offers_input]


def test_prepare_reuses_the_workspace_and_a_rebuild_unbinds_other_models():
    for actions, both_bound, after_rebuild, launches in run_threaded(_prepare_twice, TP2, timeout=60):
        assert actions == ["created", "reused", "reused", "rebuilt"]
        assert all(all(b) and len(b) == 5 for b in both_bound)
        assert all(after_rebuild[0]) and not any(after_rebuild[1])
        assert launches == 0


def test_prepare_refuses_to_run_inside_a_cuda_graph_capture(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _, model = tiny_model("qwen3", Parallel.single())
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture; .* call it once after building the model and before capturing"):
        prepare_flashinfer_fusion(model, manager=WorkspaceManager(ReferenceBackend()))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_prepare_rejects_a_bad_token_limit(bad):
    _, model = tiny_model("qwen3", Parallel.single())
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        prepare_flashinfer_fusion(model, max_tokens=bad, manager=WorkspaceManager(ReferenceBackend()))


def test_single_rank_models_need_no_workspace():
    with hardware_present():
        _, model = tiny_model("qwen3", Parallel.single())
    backend = ReferenceBackend()
    report = prepare_flashinfer_fusion(model, manager=WorkspaceManager(backend))
    assert report.groups == () and not report.bound and backend.events == []
    assert all("1 rank(s)" in reason or "nothing is ever owed" in reason for _, reason in report.skipped)


def _bind_failing_on_rank_1(parallel):
    counter = CollectiveCounter()
    counted = parallel.with_groups(lambda g: CountingCollectives(g, counter))
    backend = ReferenceBackend(fail_bind={1})
    with hardware_present():
        config, model = tiny_model("qwen3", counted)
    report = prepare_flashinfer_fusion(model, manager=WorkspaceManager(backend))
    return report, _all_bound(model), [e[0] for e in backend.events if e[1] == parallel.rank], counter.snapshot()


def test_a_launcher_failing_to_bind_on_one_rank_releases_the_workspace_on_all():
    results = run_threaded(_bind_failing_on_rank_1, TP2, timeout=60)
    for rank, (report, bound, events, collectives) in enumerate(results):
        assert not report.available and not any(bound) and events == ["create", "destroy"]
        assert ("injected bind failure" if rank == 1 else "another rank") in report.groups[0].reason
        # over the first stage's group (layer 0's FFN input owes the attention-TP sum): the host
        # check, then agreements on the probe, on reuse, on creation, on binding, and the release barrier
        assert collectives == {"agree@attn_tp": 5, "all_gather@attn_tp": 1}
    assert results[0][3] == results[1][3]


def _one_rank_without_providers(parallel):
    backend = ReferenceBackend()
    with hardware_present():
        config, model = tiny_model("qwen3", parallel)
    if parallel.rank == 1:  # as if the factory had declined here (no GPU seen, plugin disabled on this rank)
        for boundary in boundaries_of(model):
            kept = tuple((p, s) for p, s in boundary.plan.providers if not isinstance(p, FlashInferFusion))
            boundary.plan = attrs.evolve(boundary.plan, providers=kept)  # plans are frozen: a plan without it
    prompts = prompt_batches(config)
    before = model_logits(model, parallel, prompts)
    report = prepare_flashinfer_fusion(model, manager=WorkspaceManager(backend))
    after = model_logits(model, parallel, prompts)
    return report, backend.events, len(backend.launches), all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_rank_without_the_provider_keeps_every_rank_unfused():
    results = run_threaded(_one_rank_without_providers, TP2, timeout=60)
    for rank, (report, events, launches, same) in enumerate(results):
        assert not report.available and events == [] and launches == 0 and same
        assert ("not attached to this stage on this rank" if rank == 1 else "another rank") in report.groups[0].reason


def _disabled(parallel):
    backend = ReferenceBackend()
    with hardware_present():
        _, model = tiny_model("qwen3", parallel)
    return prepare_flashinfer_fusion(model, manager=WorkspaceManager(backend)), backend.events


def test_the_switch_turns_the_plugin_off_on_every_rank(monkeypatch):
    monkeypatch.setenv("LAYER_BOUNDARY_FLASHINFER", "0")
    for report, events in run_threaded(_disabled, TP2, timeout=60):
        assert not report.available and not report.bound and events == []
        assert "LAYER_BOUNDARY_FLASHINFER=0" in report.groups[0].reason


def _limits_differ(parallel):
    backend = ReferenceBackend()
    with hardware_present():
        config, model = tiny_model("qwen3", parallel)
    # a rank-dependent limit would fuse a batch on one rank and not on the other: a hang
    report = prepare_flashinfer_fusion(model, max_tokens=64 if parallel.rank == 0 else 32, manager=WorkspaceManager(backend))
    return report, backend.events


def test_ranks_with_different_settings_stay_unfused():
    for report, events in run_threaded(_limits_differ, TP2, timeout=60):
        assert not report.available and events == []
        assert "different flashinfer settings" in report.groups[0].reason


@pytest.mark.parametrize("fmt", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_fp8_reads_take_the_fused_quantizing_candidate(name, fmt):
    """Attention and dense-FFN inputs read FP8: their owed sums go to the fused all-reduce + add
    + norm + quantization (the reference backend quantizes as the core's read does: bitwise)."""
    results = run_threaded(on_off_run, TP2, name, {}, 64, False, {"layer_boundary_fp8": fmt}, timeout=60)
    for res in results:
        report = res["report"]
        assert report.available and len(report.bound) == 5
        launches = res["launches"]
        assert launches["all_reduce_fp8"] > 0
        if name == "qwen3":  # every input reads FP8 (the final norm is a plain read, unfused)
            assert launches["all_reduce"] == 0 and launches["finalize"] == 0
        else:  # the MoE inputs keep the plain read; a MoE's handoff to an FP8 read combines in torch
            assert launches["all_reduce"] > 0 and launches["finalize"] == 0 and report.finalize
        assert all(torch.equal(a, b) for a, b in zip(res["unfused"], res["fused"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["fused"], results[1]["fused"]))


def test_fp8_candidates_decline_where_the_plain_ones_do():
    from layer_boundary_flashinfer.provider import AllReduceAddNormFp8, Fp8HandoffAddNorm

    cand = AllReduceAddNormFp8()
    handoff = Fp8HandoffAddNorm(cand)
    group = _Group()
    rows = torch.ones(5, 2, 16)
    small = MoeFinalizeHandoff(rows[:3], torch.full((3, 2), 0.5), None, None, group, SumGroup.MOE_OUTPUT)
    assert handoff(small, torch.ones(3, 16)) is None  # not bound
    calls = []
    cand.bind(lambda x, r, t: calls.append((x, t)) or ("q", r), limit=4, dtype=torch.float32, hidden=16, group=group, cuda=False)
    big = MoeFinalizeHandoff(rows, torch.full((5, 2), 0.5), None, None, group, SumGroup.MOE_OUTPUT)
    assert handoff(big, torch.ones(5, 16)) is None and not calls  # above the limit
    assert handoff(small, torch.ones(3, 16, dtype=torch.float64)) is None  # another dtype
    out = handoff(small, torch.ones(3, 16))
    assert out[0] == "q" and len(calls) == 1 and calls[0][1] == 3
    assert torch.equal(calls[0][0], torch.ones(3, 16))  # combined in torch: 0.5 + 0.5
    handoff.unbind()
    assert not cand.bound
