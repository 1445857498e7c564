"""Grid stacks under a context-parallel batch in the threaded world: every CP layout, order and
reduction policy gives a single rank's bits (float64 grid arithmetic), captures included, and
the collectives issued are the CP path's, not the ordinary one's."""

import pytest
import torch

from layer_boundary import Topology
from layer_boundary.testing.grid import GridSpec, grid_inputs, reference, run_grid_rank
from layer_boundary.testing.threaded import run_threaded

from cp_grid import assert_matches_single_rank, planning_parallel, reference_spec, run_cp_grid_rank

#: shard-mode and full-row attention and mixers, dense, LOCAL_TAIL and MoE FFNs, transforms
MIXED = GridSpec(
    stages=("shard_attn", "ffn", "attn", "tail", "shard_mixer", "mixer", "ffn", "mixer", "shard_attn", "moe"),
    transforms=(0, 3, 6),
    seed=5,
)
DENSE = GridSpec(stages=("shard_attn", "ffn") * 3, seed=2)

TOPOLOGIES = {
    "cp2": Topology(tp=2, attn_cp=2),
    "cp2xtp2": Topology(tp=4, attn_cp=2),
    "cp4": Topology(tp=4, attn_cp=4),
    "cp2-ep2": Topology(tp=2, attn_cp=2, moe_ep=2),
}
#: uneven request lengths, none divisible by 2 * attn_cp; a 1-token request leaves ranks without its rows
LENGTHS = (5, 1, 7, 3)


@pytest.mark.parametrize("order", ["zigzag", "contiguous"])
@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_cp_stacks_give_a_single_ranks_bits(topo, order):
    topology = TOPOLOGIES[topo]
    results = run_threaded(run_cp_grid_rank, topology, MIXED, LENGTHS, order=order, policy="ar", captures=(0, 2, 4))
    assert_matches_single_rank(results, MIXED, sum(LENGTHS), captures=(0, 2, 4))


@pytest.mark.parametrize("policy", ["ar", "rs", "rsv", "rs+rsv"])
@pytest.mark.parametrize("topo, lengths", [("cp2", (4, 4)), ("cp2", (6, 3)), ("cp2xtp2", (8,)), ("cp2xtp2", (5, 2))])
def test_every_reduction_policy(topo, lengths, policy):
    topology = TOPOLOGIES[topo]
    results = run_threaded(run_cp_grid_rank, topology, MIXED, lengths, policy=policy)
    assert_matches_single_rank(results, MIXED, sum(lengths))


DP_CASES = {
    "dp2xcp2": (Topology(tp=4, attn_dp=2, attn_cp=2), ((5, 1), (3, 4, 2))),
    "dp2xcp2-idle": (Topology(tp=4, attn_dp=2, attn_cp=2), ((), (7,))),
    "dp2xcp2xtp2": (Topology(tp=8, attn_dp=2, attn_cp=2), ((6,), (1, 2))),
}


@pytest.mark.parametrize("padding", ["sum_len", "max_len"])
@pytest.mark.parametrize("policy", ["ar", "rs+rsv"])
@pytest.mark.parametrize("case", list(DP_CASES))
def test_cp_inside_attention_dp(case, policy, padding):
    """Each DP rank's batch is partitioned over its CP ranks; FFNs gather over CP then DP and
    return by all-reduce, DP rank's rows, CP rank's rows (never a reduce-scatter: a mapping only
    knows its own DP rank's partition)."""
    topology, lengths = DP_CASES[case]
    results = run_threaded(run_cp_grid_rank, topology, MIXED, lengths, policy=policy, padding=padding, captures=(0, 2))
    assert_matches_single_rank(results, MIXED, lengths, captures=(0, 2), topology=topology)
    assert not any(key.startswith("reduce_scatter") for key in results[0][2])


@pytest.mark.parametrize("lengths", [(1,), (2,), (0, 3)], ids=["one-token", "two-tokens", "empty-request"])
def test_ranks_without_rows_still_join_every_collective(lengths):
    """With fewer rows than CP ranks some ranks hold nothing; they still gather and scatter."""
    results = run_threaded(run_cp_grid_rank, TOPOLOGIES["cp4"], MIXED, lengths, policy="rs+rsv")
    assert_matches_single_rank(results, MIXED, sum(lengths))


@pytest.mark.parametrize("topo", ["cp2", "cp2xtp2"])
def test_postprocess_returns_reduced_outputs_to_cp_rows(topo):
    """Operation-scheduled compute (no exit scope, fully reduced) comes back to CP rows."""
    results = run_threaded(run_cp_grid_rank, TOPOLOGIES[topo], MIXED, LENGTHS, scheduled=True)
    assert_matches_single_rank(results, MIXED, sum(LENGTHS))


def _two_segments(parallel, spec, lengths, split):
    """A pipeline cut at `split`: each segment gets its own Forward with the same token mapping."""
    from layer_boundary import Forward
    from layer_boundary.testing.grid import GridModel
    from layer_boundary_cp import TokenMapping

    n = sum(lengths)
    x = grid_inputs(spec, (n,))[0]
    first = GridModel(spec, parallel, segment=(0, split))
    second = GridModel(spec, parallel, segment=(split, len(spec.stages)))
    tensors = first.run(x, Forward(parallel, n, cp=TokenMapping(parallel, lengths)))
    assert all(t is None or t.shape[0] == n for t in tensors.values() if not isinstance(t, bool))  # pipeline tensors travel on token-order rows
    fwd = Forward(parallel, n, cp=TokenMapping(parallel, lengths))
    return second.run(second.boundaries[0].from_pp(tensors, fwd), fwd)


@pytest.mark.parametrize("split", [1, 2, 5, 6], ids=lambda s: f"cut{s}")
@pytest.mark.parametrize("topo", ["cp2", "cp2xtp2"])
def test_a_pipeline_cut_inside_a_cp_batch(topo, split):
    """to_pp() exports token-order rows (a declared attention-TP partial gathered over CP);
    from_pp() puts them back on CP rows."""
    spec = GridSpec(stages=("attn", "ffn", "attn", "tail", "mixer", "mixer", "ffn", "mixer", "attn", "moe"), transforms=(0, 3), seed=5)
    results = run_threaded(_two_segments, TOPOLOGIES[topo], spec, LENGTHS, split)
    (expected,), _ = reference(spec, grid_inputs(spec, (sum(LENGTHS),)))
    for out in results:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("topo", ["cp2", "cp2xtp2"])
def test_captured_inputs_land_on_the_compute_input_rows(topo):
    """`captured_last_layer_outputs`: the updated residual on the rows the stage's compute gets:
    this CP rank's rows for a shard-mode stage, token-order rows for one whose input is gathered."""
    from layer_boundary_cp import TokenMapping

    topology, captures = TOPOLOGIES[topo], (2, 4, 8)
    results = run_threaded(run_cp_grid_rank, topology, MIXED, LENGTHS, captures=captures, capture_inputs=True)
    _, (expected,) = reference(reference_spec(MIXED), grid_inputs(MIXED, (sum(LENGTHS),)), captures=captures)
    for rank, (_, caps, _) in enumerate(results):
        mapping = TokenMapping(planning_parallel(topology, rank), LENGTHS)
        assert [i for i, _ in caps] == [i for i, _ in expected]
        for (i, got), (_, want) in zip(caps, expected):
            want = mapping.take_local(want) if MIXED.stages[i].startswith("shard_") else want
            assert torch.equal(got, want), (rank, i)


def test_the_cp_path_issues_cp_collectives():
    """Shard-mode attention on CP rows, FFN input gathered over CP, FFN output reduce-scattered
    over TP (then gathered over attention TP), final rows gathered over CP."""
    topology = TOPOLOGIES["cp2xtp2"]
    _, _, counts = run_threaded(run_cp_grid_rank, topology, DENSE, (6, 3), policy="rs+rsv")[0]
    assert counts == {
        # per layer: the attention's own gather, the FFN input gather; plus the final norm's gather
        "all_gatherv@attn_cp": 3 * 2 + 1,
        # the attention-TP sum completes on CP rows; the FFN output is reduce-scattered, then gathered over attention TP
        "all_reduce@attn_tp": 3,
        "reduce_scatterv@tp": 3,
        "all_gatherv@attn_tp": 3,
    }
    _, _, counts = run_threaded(run_cp_grid_rank, topology, DENSE, (6, 3), policy="ar")[0]
    assert counts == {"all_gatherv@attn_cp": 7, "all_reduce@attn_tp": 3, "all_reduce@tp": 3}


def test_the_ordinary_path_runs_when_the_batch_is_not_cp():
    """Decode batches stay ordinary under a CP topology: rows replicated over CP ranks."""
    topology = TOPOLOGIES["cp2xtp2"]
    results = run_threaded(run_cp_grid_rank, topology, DENSE, (3, 2), cp=False)
    assert_matches_single_rank(results, DENSE, 5)
    assert not any("attn_cp" in key for key in results[0][2])


@pytest.mark.parametrize("topo", ["cp2", "cp2xtp2"])
def test_core_grid_decode_under_a_cp_topology(topo):
    """The core's grid stack, built under a CP topology (so with CP paths), decodes ordinary."""
    spec = GridSpec(stages=("attn", "moe", "mixer", "ffn"), seed=3)
    results = run_threaded(run_grid_rank, TOPOLOGIES[topo], spec, (2,), mode="decode")
    (expected,), _ = reference(spec, grid_inputs(spec, (2,)))
    for out, _ in results:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
def test_a_model_rank_without_rows_joins_the_kv_gather(tmp_path, model):
    """A 1-token and a 2-token prompt over 4 CP ranks: some ranks hold no row at all, yet every
    rank's attention joins the KV all-gather and the logits match a single rank."""
    import attrs

    from layer_boundary import Parallel
    from layer_boundary_models import family, model_config
    from layer_boundary.cli.runner import RunJob, run_rank

    config = model_config(model)
    path = tmp_path / "weights.pt"
    torch.save(family(model).random_weights(config, torch.float64, seed=3), path)
    job = RunJob(
        model=model, hf_config=dict(config.hf), topology=Topology(), reduction="ar", dtype="float64",
        weights=str(path), prompts=((17,), (3, 99)), decode_tokens=((5, 6),),
    )
    single = run_rank(Parallel.single(), job)["logits"]
    topology = Topology(tp=4, attn_cp=4)
    results = run_threaded(run_rank, topology, attrs.evolve(job, topology=topology, options={"cp_order": "zigzag"}))
    assert results[0]["collectives"]["prefill"]["all_gatherv@attn_cp"] == 2 * config.num_layers + 1
    got = results[0]["logits"]
    for r in (0, 1):
        for ours, theirs in zip(got[r], single[r]):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
