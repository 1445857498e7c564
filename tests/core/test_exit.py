"""Exit decisions: what is published to compute, and that the completion matches it."""

import pytest
import torch

from layer_boundary import (
    ComputeFlags,
    FfnExit,
    Forward,
    MoeFinalizeHandoff,
    OwedOutput,
    Parallel,
    ProducerReduction,
    RMSNorm,
    SumGroup,
    Topology,
    declare_attn,
    declare_ffn,
    exit_scope_open,
    get_forward,
    make_stages,
    residual_batch,
)
from layer_boundary.testing.threaded import run_threaded

H = 4


def _norm():
    return RMSNorm(H, dtype=torch.float64)


def _flags_seen(parallel, *, policy="ar", counts=None, padding="sum_len", variant=None, following=None, terminal=False, ffn=None):
    """Run one layer and report the flags the FFN's compute saw and the handle type."""
    attn, stage = make_stages(
        (declare_attn(), _norm()),
        (ffn or declare_ffn(), _norm()),
        terminal=terminal,
        following=following,
        parallel=parallel,
        reduction=policy,
    )
    counts = counts or (4,) * parallel.attn_dp
    n = counts[parallel.attn_dp_rank]
    kwargs = {"sequence_parallel": True} if variant == "sp" else {}
    fwd = Forward(parallel, n, dp_counts=counts, dp_padding=padding, **kwargs)
    residual_batch.start(fwd)
    h = torch.ones(n, H, dtype=torch.float64)
    h = attn.finish(attn.prepare(h, fwd), fwd)
    x = stage.prepare(h, fwd)
    with stage.exit(fwd) as out:
        seen = get_forward()
        y = x * 0.25 if seen.skips_reduction else parallel.groups["tp"].all_reduce(x * 0.25)
    after = get_forward()
    handle = out.finish(y)
    return seen, after, type(handle).__name__


def test_ffn_defers_its_all_reduce_to_the_next_input_under_tp():
    seen, after, handle = run_threaded(_flags_seen, Topology(tp=2))[0]
    assert seen == ComputeFlags(fuse_mlp_allreduce=True)
    assert after == ComputeFlags()  # restored
    assert handle == "OwedOutput"


def test_terminal_ffn_completes_now():
    seen, _, handle = run_threaded(lambda p: _flags_seen(p, terminal=True), Topology(tp=2))[0]
    assert not seen.skips_reduction and handle == "Tensor"


def test_local_tail_never_defers():
    ffn = declare_ffn(reduction=ProducerReduction.LOCAL_TAIL)
    seen, _, handle = run_threaded(lambda p: _flags_seen(p, ffn=ffn), Topology(tp=2))[0]
    assert seen == ComputeFlags() and handle == "Tensor"


@pytest.mark.parametrize(
    "policy, padding, rs",
    [("ar", "sum_len", False), ("rsv", "sum_len", True), ("rs", "sum_len", False), ("rs", "max_len", True), ("rsv", "max_len", False), ("rs+rsv", "sum_len", True), ("rs+rsv", "max_len", True)],
)
def test_attention_dp_scatter_choice_follows_policy_and_padding(policy, padding, rs):
    results = run_threaded(lambda p: _flags_seen(p, policy=policy, padding=padding, counts=(3, 1)), Topology(tp=4, attn_dp=2))
    for rank, (seen, _, handle) in enumerate(results):
        assert seen.mlp_reduce_scatter is rs
        assert not seen.fuse_mlp_allreduce  # never deferred under attention DP
        assert seen.owns_local_tail is (not rs or rank == 0)
        assert handle == "Tensor"


def test_sequence_parallel_reduce_scatters_when_allowed():
    seen, _, _ = run_threaded(lambda p: _flags_seen(p, policy="rs+rsv", variant="sp"), Topology(tp=2))[0]
    assert seen.mlp_reduce_scatter
    seen, _, _ = run_threaded(lambda p: _flags_seen(p, policy="ar", variant="sp"), Topology(tp=2))[0]
    assert not seen.skips_reduction


def _mixer_decision(parallel, following, counts=(4,), n=None):
    (mixer,) = make_stages(
        (declare_attn(reduction=ProducerReduction.SCOPED), _norm()), following=following, parallel=parallel, label="m"
    )
    counts = counts if parallel.attn_dp > 1 else (n if n is not None else 4,)
    fwd = Forward(parallel, counts[parallel.attn_dp_rank], dp_counts=counts)
    residual_batch.start(fwd)
    x = mixer.prepare(torch.ones(counts[parallel.attn_dp_rank], H, dtype=torch.float64), fwd)
    with mixer.exit(fwd) as out:
        skips = out.skips_reduction
        assert get_forward().fuse_mlp_allreduce is skips
    return skips, isinstance(out.finish(x), OwedOutput)


def test_mixer_leaves_its_sum_before_an_ffn_always():
    assert run_threaded(lambda p: _mixer_decision(p, declare_ffn()), Topology(tp=2))[0] == (True, True)
    dp = run_threaded(lambda p: _mixer_decision(p, declare_ffn(), counts=(2, 3)), Topology(tp=4, attn_dp=2))
    assert all(r == (True, True) for r in dp)


def test_mixer_defers_before_a_mixer_only_without_attention_dp_and_with_tokens():
    nxt = declare_attn(reduction=ProducerReduction.SCOPED)
    assert run_threaded(lambda p: _mixer_decision(p, nxt), Topology(tp=2))[0] == (True, True)
    assert run_threaded(lambda p: _mixer_decision(p, nxt, n=0), Topology(tp=2))[0] == (False, False)
    dp = run_threaded(lambda p: _mixer_decision(p, nxt, counts=(2, 3)), Topology(tp=4, attn_dp=2))
    assert all(r == (False, False) for r in dp)


def test_flags_are_restored_when_compute_raises():
    (attn, ffn) = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), parallel=Parallel.single())
    fwd = Forward(Parallel.single(), 2)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd), fwd)
    ffn.prepare(h, fwd)
    with pytest.raises(ZeroDivisionError):
        with ffn.exit(fwd):
            1 / 0
    assert get_forward() == ComputeFlags()


def test_returning_a_handoff_without_defer_moe_finalize_fails_in_finish():
    (attn, ffn) = make_stages((declare_attn(), _norm()), (declare_ffn(sparse=True), _norm()), parallel=Parallel.single())
    fwd = Forward(Parallel.single(), 2)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd), fwd)
    x = ffn.prepare(h, fwd)
    g = Parallel.single().groups["tp"]
    with ffn.exit(fwd) as out:
        handoff = MoeFinalizeHandoff(x[:, None, :], torch.ones(2, 1, dtype=torch.float64), None, None, g, SumGroup.MOE_OUTPUT)
    with pytest.raises(RuntimeError, match="did not publish defer_moe_finalize"):
        out.finish(handoff)


def test_finish_is_for_attention_and_exit_for_ffn():
    (attn, ffn) = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), parallel=Parallel.single())
    fwd = Forward(Parallel.single(), 2)
    with pytest.raises(RuntimeError, match="publishes its output through exit"):
        ffn.finish(torch.ones(2, H), fwd)
    with pytest.raises(RuntimeError, match="publishes its output with finish"):
        attn.exit(fwd)


def test_finish_once_per_exit():
    (attn, ffn) = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), parallel=Parallel.single(), terminal=True)
    fwd = Forward(Parallel.single(), 2)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd), fwd)
    x = ffn.prepare(h, fwd)
    with ffn.exit(fwd) as out:
        pass
    out.finish(x)
    with pytest.raises(RuntimeError, match="already called"):
        out.finish(x)


def _one_rank_layer():
    """A TP=1 attention + FFN pair: the attention exit only records, the FFN exit is plain
    (the slotted fast paths), with the stream at the FFN's input."""
    (attn, ffn) = make_stages((declare_attn(), _norm()), (declare_ffn(), _norm()), parallel=Parallel.single(), terminal=True)
    fwd = Forward(Parallel.single(), 2)
    residual_batch.start(fwd)
    h = attn.finish(attn.prepare(torch.ones(2, H, dtype=torch.float64), fwd), fwd)
    return attn, ffn, fwd, ffn.prepare(h, fwd)


def test_plain_ffn_exit_publishes_its_flags_and_is_entered_once():
    _, ffn, fwd, x = _one_rank_layer()
    scope = ffn.exit(fwd)
    assert isinstance(scope, FfnExit) and scope.flags == ComputeFlags() and not scope.fuse_mlp_allreduce
    with scope as out:
        assert exit_scope_open() and get_forward() is out.flags
    assert not exit_scope_open()
    with pytest.raises(RuntimeError, match="an exit scope is entered once"):
        with scope:
            pass
    assert out.finish(x) is x


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.ones(3, H, dtype=torch.float64), "FFN output has shape"),
        (torch.ones(2, H + 1, dtype=torch.float64), "FFN output has hidden size"),
        (torch.ones(2, H, dtype=torch.float32), "FFN output is torch.float32 but the residual is torch.float64"),
    ],
)
def test_plain_ffn_exit_refuses_a_malformed_output(bad, match):
    _, ffn, fwd, _ = _one_rank_layer()
    with ffn.exit(fwd) as out:
        pass
    with pytest.raises(ValueError, match=match):
        out.finish(bad)


def test_one_rank_exits_refuse_to_replace_a_pending_contribution():
    attn, ffn, fwd, x = _one_rank_layer()
    with ffn.exit(fwd) as out:
        pass
    out.finish(x)  # pending now
    with pytest.raises(RuntimeError, match="cannot replace an unconsumed producer contribution"):
        attn.finish(torch.ones(2, H, dtype=torch.float64), fwd)
    with ffn.exit(fwd) as again:
        pass
    with pytest.raises(RuntimeError, match="cannot replace an unconsumed producer contribution"):
        again.finish(torch.ones(2, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="attention output is torch.float32"):
        attn.finish(torch.ones(2, H, dtype=torch.float32), fwd)
