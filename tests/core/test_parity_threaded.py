"""Bit-exact parity with a single rank, in the threaded world (float64, grid arithmetic)."""

import pytest

from layer_boundary import Topology
from layer_boundary.testing.grid import GridSpec, run_grid_rank
from layer_boundary.testing.threaded import run_threaded

from grid_cases import assert_matches_reference

DENSE = GridSpec(stages=("attn", "ffn") * 4)
MOE = GridSpec(stages=("attn", "moe") * 4, seed=3)
MIXED = GridSpec(
    stages=("attn", "ffn", "attn", "tail", "mixer", "mixer", "ffn", "mixer", "attn", "moe"), transforms=(0, 3), seed=5
)
PAIRED = GridSpec(stages=("attn", "ffn", "attn", "moe", "attn", "ffn"), paired=True, seed=7)

TOPOLOGIES = {
    "tp1": (Topology(tp=1), (6,)),
    "tp2": (Topology(tp=2), (5,)),
    "tp4": (Topology(tp=4), (7,)),
    "dp2xtp2": (Topology(tp=4, attn_dp=2), (5, 3)),
    "dp2xtp2-zero": (Topology(tp=4, attn_dp=2), (0, 4)),
    "dp2xtp1": (Topology(tp=2, attn_dp=2), (3, 0)),
    "dp4": (Topology(tp=4, attn_dp=4), (2, 0, 3, 1)),
    "tp4-ep2": (Topology(tp=4, moe_ep=2), (6,)),
    "tp4-ep4": (Topology(tp=4, moe_ep=4), (3,)),
}
POLICIES = ["ar", "rs", "rsv", "rs+rsv"]


@pytest.mark.parametrize("spec", [DENSE, MOE, MIXED, PAIRED], ids=["dense", "moe", "mixed", "paired"])
@pytest.mark.parametrize("topo", list(TOPOLOGIES), ids=list(TOPOLOGIES))
def test_stacks_match_a_single_rank(spec, topo):
    topology, counts = TOPOLOGIES[topo]
    if "ep" in topo and spec is DENSE:
        pytest.skip("expert parallel needs a MoE stage")
    results = run_threaded(run_grid_rank, topology, spec, counts, captures=(0, 4))
    assert_matches_reference(results, spec, topology, counts, captures=(0, 4))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("padding", ["sum_len", "max_len"])
@pytest.mark.parametrize("counts", [(5, 3), (0, 2), (4, 4)], ids=["uneven", "zero", "even"])
def test_every_reduction_policy_under_attention_dp(policy, padding, counts):
    topology = Topology(tp=4, attn_dp=2)
    results = run_threaded(run_grid_rank, topology, MIXED, counts, policy=policy, padding=padding)
    assert_matches_reference(results, MIXED, topology, counts)


@pytest.mark.parametrize("variant", ["sp", "is"])
@pytest.mark.parametrize("policy", ["ar", "rs", "rs+rsv"])
@pytest.mark.parametrize("tp, n", [(2, 5), (4, 8), (4, 3)])
def test_sequence_parallel_and_input_scattered(variant, policy, tp, n):
    topology = Topology(tp=tp)
    results = run_threaded(run_grid_rank, topology, MIXED, (n,), policy=policy, variant=variant, captures=(0, 8))
    assert_matches_reference(results, MIXED, topology, (n,), captures=(0, 8))


@pytest.mark.parametrize(
    "topo, split, variant",
    [
        ("tp2", 2, None),  # cut between layers: the FFN's deferred sum completes before the handoff
        ("tp2", 1, None),  # cut between attention and FFN: the declared sum travels unreduced
        ("dp2xtp2", 3, None),
        ("dp2xtp2", 4, None),
        ("tp4", 5, "sp"),
        ("tp4", 6, None),  # between two mixers
        ("tp1", 1, None),  # attention TP of one: the transformed output travels complete, transformed once
        ("dp2xtp1", 1, None),
    ],
)
def test_pipeline_split_into_two_segments(topo, split, variant):
    topology, counts = TOPOLOGIES[topo]
    results = run_threaded(run_grid_rank, topology, MIXED, counts, split=split, variant=variant, captures=(0, 8))
    assert_matches_reference(results, MIXED, topology, counts, captures=(0, 8))


@pytest.mark.parametrize("topo", ["tp1", "tp2", "tp4", "dp2xtp2"])
def test_decode_batches(topo):
    topology, _ = TOPOLOGIES[topo]
    counts = (1,) * topology.attn_dp
    results = run_threaded(run_grid_rank, topology, MOE, counts, mode="decode")
    assert_matches_reference(results, MOE, topology, counts)
