"""TBO and branches under real gloo processes: bit-exact (exact stacks, float64) and the
Qwen3-MoE reference model with TBO against Hugging Face."""

import functools

import attrs
import pytest
import torch

from layer_boundary.testing import logits_rel_error

from layer_boundary import Topology
from layer_boundary_models import family, model_config
from layer_boundary.cli.oracle import hf_from_state, hf_logits
from layer_boundary.cli.runner import RunJob, make_requests, run_rank

from tbo_exact_branch import plain_reference, run_branch_rank
from tbo_exact_stack import reference, run_exact_rank, split_of

pytestmark = pytest.mark.gloo

LAYERS = ("ffn", "moe", "moe")

EXACT = [
    # (topology, requests per DP rank, kwargs)
    (Topology(tp=2), [[2, 1, 3, 1]], {"policy": "ar"}),
    (Topology(tp=2), [[2, 1, 3, 1]], {"policy": "rs+rsv", "sp": True, "scheduled": (1,)}),
    (Topology(tp=2, attn_dp=2), [[2, 1], [1, 2, 1]], {"policy": "rsv", "tbo_from": 1}),
    (Topology(tp=4, attn_dp=2), [[2, 1, 3], [1, 1]], {"policy": "rs+rsv", "padding": "max_len"}),
]


@pytest.mark.parametrize("topology, dp_segments, kwargs", EXACT, ids=["tp2", "tp2-sp-scheduled", "dp2-mid-stack", "dp2xtp2-maxlen"])
def test_tbo_on_and_off_are_bit_identical_under_gloo(gloo_world, topology, dp_segments, kwargs):
    world = gloo_world(topology.world_size)
    on = world.run(run_exact_rank, topology, LAYERS, dp_segments, tbo=True, split=split_of(dp_segments), **kwargs)
    kwargs.pop("tbo_from", None)
    off = world.run(run_exact_rank, topology, LAYERS, dp_segments, **kwargs)
    ref = reference(LAYERS, dp_segments)
    for rank, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), f"rank {rank}: TBO on and off differ by {(a - b).abs().max().item()}"
        assert torch.equal(a, ref[topology.coordinates(rank)["attn_dp"]]), f"rank {rank} differs from a single rank"


@pytest.mark.parametrize(
    "topology, dp_segments, kwargs",
    [
        (Topology(tp=2), [[2, 1, 3]], {"tbo": True, "split": (3,)}),
        (Topology(tp=2, attn_dp=2), [[2, 1], [3]], {"policy": "rsv"}),
    ],
    ids=["tp2-tbo", "dp2"],
)
def test_branch_stack_under_gloo(gloo_world, topology, dp_segments, kwargs):
    results = gloo_world(topology.world_size).run(run_branch_rank, topology, dp_segments, **kwargs)
    ref = plain_reference(dp_segments)
    for rank, out in enumerate(results):
        assert torch.equal(out, ref[topology.coordinates(rank)["attn_dp"]]), rank


@functools.lru_cache(maxsize=None)
def _qwen3_moe(weights_dir):
    config = model_config("qwen3_moe")
    state = family("qwen3_moe").random_weights(config, torch.float64, seed=11)
    path = f"{weights_dir}/qwen3_moe-tbo.pt"
    torch.save(state, path)
    # prompt lengths 6, 7, 8: the token midpoint cuts a request in prefill on every layout
    prompts, decode = make_requests(config.vocab_size, 3, 7, 2, seed=5)
    ref = hf_logits(hf_from_state(dict(config.hf), state, torch.float64), [torch.tensor(p) for p in prompts], decode)
    job = RunJob(
        model="qwen3_moe", hf_config=dict(config.hf), topology=Topology(), reduction="ar", dtype="float64",
        weights=path, prompts=prompts, decode_tokens=decode, options={"tbo": True},
    )
    return job, ref


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tbo-weights"))


_worst = logits_rel_error  # the shared logits comparison (also checks steps, shapes, finiteness)


@pytest.mark.parametrize(
    "topology, reduction, prefill",
    [
        (Topology(tp=2), "ar", {"all_reduce@attn_tp": 8, "all_reduce@tp": 8}),
        (Topology(tp=4, attn_dp=2), "rs+rsv", {"all_gatherv@attn_tp": 8, "all_reduce@tp": 8, "reduce_scatterv@tp": 8}),
    ],
    ids=["tp2", "dp2xtp2"],
)
def test_qwen3_moe_with_tbo_matches_hf(gloo_world, weights_dir, topology, reduction, prefill):
    job, ref = _qwen3_moe(weights_dir)
    job = attrs.evolve(job, topology=topology, reduction=reduction)
    results = gloo_world(topology.world_size).run(run_rank, topology, job)
    assert _worst(results, ref) < 1e-10
    # the prefill ran as two microbatches: each of the 4 layers' collectives twice
    assert results[0]["collectives"]["prefill"] == prefill
