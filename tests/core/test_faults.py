"""Fault injection: each fault ends in a clear error or a rank-uniform fallback, never a hang."""

import os

import pytest
import torch

from layer_boundary import (
    BatchFactsError,
    CountingCollectives,
    Forward,
    FusedMlpInput,
    FusionError,
    RMSNorm,
    SumGroup,
    Topology,
    declare_attn,
    declare_ffn,
    make_stages,
    residual_batch,
)
from layer_boundary import _debug as debug_module
from layer_boundary.plugin import add_rms_norm
from layer_boundary.testing.threaded import CollectiveAborted, ThreadWorld, run_threaded

H = 4


class WorkspaceProvider:
    """A fusion whose setup allocates a per-group workspace; `agree` makes the decision to use
    it rank-uniform. Its fused path uses a different collective (all_gather + local sum) from the
    unfused one (all_reduce), as a real one-shot all-reduce kernel would."""

    def __init__(self, fails_on_rank: int, agree: bool):
        self.fails_on_rank, self.use_agreement = fails_on_rank, agree
        self.usable = None
        self.taken = 0

    def setup(self, parallel) -> None:
        ok = parallel.rank != self.fails_on_rank  # the allocation fails on one rank
        group = parallel.groups["tp"]
        self.usable = group.agree(ok) if self.use_agreement else ok

    def ffn_input(self, plan):
        norm, group = plan.norm, plan.group(SumGroup.TP)

        def run(owed, residual, fwd):
            if not self.usable:
                return None
            self.taken += 1
            total = group.all_gather(owed.partial[None]).sum(0)
            return add_rms_norm(norm, total, residual)

        return (FusedMlpInput(run=run, name="test.workspace_fusion", completes=SumGroup.ATTN_TP),)


def _forward_with(parallel, provider, counter=None):
    if counter is not None:
        parallel = parallel.with_groups(lambda g: CountingCollectives(g, counter))
    if provider is not None:
        provider.setup(parallel)
    opts = {"fusions": provider} if provider is not None else {}
    attn, ffn = make_stages((declare_attn(), RMSNorm(H, dtype=torch.float64)), (declare_ffn(), RMSNorm(H, dtype=torch.float64), opts), terminal=True, parallel=parallel)
    fwd = Forward(parallel, 3)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.arange(12, dtype=torch.float64).reshape(3, 4) / 8, fwd) * 0.5, fwd)
    y = ffn.prepare(h, fwd)
    with ffn.exit(fwd) as out:
        y = parallel.groups["tp"].all_reduce(y * 0.25)
    return residual_batch.norm(out.finish(y), fwd, RMSNorm(H, dtype=torch.float64))


def test_one_ranks_workspace_failing_turns_the_fusion_off_on_every_rank():
    reference = run_threaded(lambda p: _forward_with(p, None), Topology(tp=2))
    providers = []

    def fn(parallel):
        provider = WorkspaceProvider(fails_on_rank=1, agree=True)
        providers.append(provider)
        return _forward_with(parallel, provider)

    results = run_threaded(fn, Topology(tp=2))
    assert all(torch.equal(a, b) for a, b in zip(results, reference))
    assert [p.usable for p in providers] == [False, False] and all(p.taken == 0 for p in providers)


def test_without_agreement_the_ranks_would_diverge_and_the_world_names_it():
    # rank 0's fused path all-gathers, rank 1's unfused path all-reduces: a real backend would hang
    with pytest.raises((CollectiveAborted, FusionError), match="issued different collectives: rank 0: all_gather .* rank 1: all_reduce"):
        ThreadWorld(2, timeout=10).run(lambda p: _forward_with(p, WorkspaceProvider(fails_on_rank=1, agree=False)), Topology(tp=2))


def test_when_every_rank_has_the_workspace_the_fusion_runs():
    providers = []

    def fn(parallel):
        provider = WorkspaceProvider(fails_on_rank=-1, agree=True)
        providers.append(provider)
        return _forward_with(parallel, provider)

    reference = run_threaded(lambda p: _forward_with(p, None), Topology(tp=2))
    assert all(torch.equal(a, b) for a, b in zip(run_threaded(fn, Topology(tp=2)), reference))
    assert all(p.taken == 1 for p in providers)


def test_ranks_disagreeing_on_batch_facts_fail_before_the_collective_in_debug_mode(monkeypatch):
    monkeypatch.setattr(debug_module, "DEBUG", True)

    def fn(parallel):
        counts = (3, 2) if parallel.rank == 0 else (4, 2)  # rank 1 believes DP rank 0 has 4 tokens
        attn, ffn = make_stages((declare_attn(), RMSNorm(H)), (declare_ffn(), RMSNorm(H)), terminal=True, parallel=parallel)
        fwd = Forward(parallel, counts[parallel.attn_dp_rank], dp_counts=counts)
        residual_batch.start(fwd)
        with pytest.raises(BatchFactsError, match="ranks disagree on batch facts: .*dp_counts\\[0\\]"):
            attn.prepare(torch.ones(counts[parallel.attn_dp_rank], H), fwd)
        return True

    assert all(run_threaded(fn, Topology(tp=2, attn_dp=2)))


def _dies_mid_forward(parallel):
    attn, ffn = make_stages((declare_attn(), RMSNorm(H)), (declare_ffn(), RMSNorm(H)), terminal=True, parallel=parallel)
    fwd = Forward(parallel, 3)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(3, H), fwd) * 0.5, fwd)
    if parallel.rank == 1:
        os._exit(3)  # the process dies between two collectives
    return ffn.prepare(h, fwd)


@pytest.mark.gloo
def test_a_rank_dying_mid_forward_fails_the_others_with_a_message():
    from layer_boundary.launch import ProcessWorld, RankError

    world = ProcessWorld(2, timeout=60, collective_timeout=5)
    world.FAILURE_GRACE_S = 15.0
    try:
        with pytest.raises(RankError) as info:
            world.run(_dies_mid_forward, Topology(tp=2))
    finally:
        world.close()
    message = str(info.value)
    assert "rank 1: died (exit code 3)" in message
