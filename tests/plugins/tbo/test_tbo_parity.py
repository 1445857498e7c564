"""Two-batch overlap on vs off: bit-exact in float64 (threaded world), on every row layout."""

import pytest
import torch

from layer_boundary import Forward, Parallel, Topology, residual_batch, two_batch_overlap
from layer_boundary.testing.threaded import run_threaded

from tbo_exact_stack import ExactStack, inputs_of, reference, run_exact_rank, split_of

LAYERS = ("ffn", "moe", "moe")

# (topology, requests per DP rank, extra kwargs)
CASES = {
    "tp1": (Topology(tp=1), [[2, 1, 3, 1]], {}),
    "tp2": (Topology(tp=2), [[2, 1, 3, 1]], {}),
    "tp4-ep2": (Topology(tp=4, moe_ep=2), [[1, 3, 1, 2, 2]], {}),
    "dp2xtp2": (Topology(tp=4, attn_dp=2), [[2, 1, 3], [1, 1]], {"policy": "rs+rsv"}),
    "dp2xtp2-maxlen": (Topology(tp=4, attn_dp=2), [[2, 1, 3], [1, 1]], {"policy": "rs+rsv", "padding": "max_len"}),
    "dp2xtp2-zero": (Topology(tp=4, attn_dp=2), [[], [1, 2, 1]], {"policy": "ar"}),
    "dp2-tp1-one-row": (Topology(tp=2, attn_dp=2), [[2, 1], [1]], {"policy": "rsv"}),
    "tp2-sp": (Topology(tp=2), [[2, 1, 3, 1]], {"sp": True, "policy": "rs+rsv"}),
    "tp4-sp": (Topology(tp=4), [[2, 2, 1, 3]], {"sp": True, "policy": "ar"}),
}


def _check(results, topology, dp_segments, **kwargs):
    ref = reference(LAYERS, dp_segments, **kwargs)
    for rank, out in enumerate(results):
        want = ref[topology.coordinates(rank)["attn_dp"]]
        assert out.shape == want.shape, (rank, out.shape, want.shape)
        assert torch.equal(out, want), f"rank {rank}: max diff {(out - want).abs().max().item()}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("where", ["stack-entry", "mid-stack", "norm-in-stages"])
def test_tbo_matches_the_serial_run_bit_for_bit(case, where):
    topology, dp_segments, kwargs = CASES[case]
    extra = {"stack-entry": {}, "mid-stack": {"tbo_from": 1}, "norm-in-stages": {"norm_in_stages": True}}[where]
    results = run_threaded(run_exact_rank, topology, LAYERS, dp_segments, tbo=True, split=split_of(dp_segments), **kwargs, **extra)
    _check(results, topology, dp_segments)


@pytest.mark.parametrize("case", ["tp2", "dp2xtp2", "tp4-ep2", "tp2-sp"])
def test_operation_scheduled_ffns_with_postprocess(case):
    """FFNs run without an exit scope, with yield points between prepare, compute and postprocess."""
    topology, dp_segments, kwargs = CASES[case]
    results = run_threaded(
        run_exact_rank, topology, LAYERS, dp_segments, tbo=True, split=split_of(dp_segments), scheduled=(0, 1, 2), **kwargs
    )
    _check(results, topology, dp_segments)


@pytest.mark.parametrize("topology, counts", [(Topology(tp=2), (3,)), (Topology(tp=4, attn_dp=2), (3, 2)), (Topology(tp=4, attn_dp=2), (0, 1))])
def test_decode_batches_split_at_the_token_midpoint(topology, counts):
    """One token per request: the default split (each rank's midpoint) falls on request boundaries."""
    dp_segments = [[1] * c for c in counts]
    results = run_threaded(run_exact_rank, topology, LAYERS, dp_segments, tbo=True, mode="decode")
    _check(results, topology, dp_segments)


def test_the_serial_run_matches_a_single_rank_too():
    """The baseline TBO is compared with: the same stack without TBO at TP 2 x DP 2."""
    topology, dp_segments, kwargs = CASES["dp2xtp2"]
    _check(run_threaded(run_exact_rank, topology, LAYERS, dp_segments, **kwargs), topology, dp_segments)


def _recorded_run(parallel, dp_segments, split=None):
    """Runs a TBO pass that records which microbatch ran which operation, with its Forward's facts."""
    model = ExactStack(LAYERS, parallel)
    segments = dp_segments[parallel.attn_dp_rank]
    x = inputs_of(dp_segments)[parallel.attn_dp_rank]
    fwd = Forward(parallel, x.shape[0], dp_counts=tuple(sum(s) for s in dp_segments))
    residual_batch.start(fwd)
    trace = []
    inner = model.stages_of(0, model.num_layers)

    def stages(h, mb_fwd, facts):
        run = inner(h, mb_fwd, facts)
        while True:
            trace.append((mb_fwd.microbatch, mb_fwd.num_tokens, mb_fwd.dp_counts, tuple(facts)))
            try:
                next(run)
            except StopIteration as stop:
                return stop.value
            yield

    from tbo_exact_stack import rows_of

    with torch.inference_mode():
        two_batch_overlap(fwd).run(stages, x, fwd, context=lambda a, b: rows_of(segments, a, b), split=split)
    return trace


def test_microbatches_alternate_and_agree_on_dp_counts():
    dp_segments = [[2, 1, 3], [1, 1, 1, 1]]
    traces = run_threaded(_recorded_run, Topology(tp=2, attn_dp=2), dp_segments, split=(3, 2))
    for dp_rank, trace in enumerate(traces):
        owners = [t[0] for t in trace]
        assert owners[:6] == [0, 1, 0, 1, 0, 1]
        assert owners.count(0) == owners.count(1)
        first = {t[2] for t in trace if t[0] == 0}
        second = {t[2] for t in trace if t[0] == 1}
        assert first == {(3, 2)} and second == {(3, 2)}
        requests = {t[0]: t[3] for t in trace}
        assert requests == ({0: (2, 1), 1: (3,)} if dp_rank == 0 else {0: (1, 1), 1: (1, 1)})


def test_a_batch_one_microbatch_would_leave_empty_runs_whole():
    """Decode with one token on each DP rank: microbatch 1 would be empty everywhere, so no split."""
    traces = run_threaded(_recorded_run, Topology(tp=2, attn_dp=2), [[1], [1]])
    for trace in traces:
        assert {t[0] for t in trace} == {None}  # the parent Forward (no microbatch) ran every stage
        assert {t[2] for t in trace} == {(1, 1)}


def test_the_comparison_catches_rows_merged_out_of_order(monkeypatch):
    """The parity check is sensitive: merging the microbatches' rows in swapped order fails it."""
    import layer_boundary_tbo.microbatch as microbatch

    dp_segments = [[2, 1, 3, 1]]
    right = run_exact_rank(Parallel.single(), LAYERS, dp_segments, tbo=True, split=split_of(dp_segments))
    assert torch.equal(right, reference(LAYERS, dp_segments)[0])
    real_cat = microbatch._cat
    monkeypatch.setattr(microbatch, "_cat", lambda values: real_cat(list(reversed(values))))
    wrong = run_exact_rank(Parallel.single(), LAYERS, dp_segments, tbo=True, split=split_of(dp_segments))
    assert not torch.equal(wrong, right)
