"""Qwen3 and Qwen3-MoE with attention context parallel on real gloo ranks: prefill as a CP batch,
decode ordinary, logits equal to Hugging Face and to a single rank (float64); and the grid stack
under gloo, bit-exact, so every CP collective runs on real process groups."""

import functools

import attrs
import pytest
import torch

from layer_boundary import Parallel, Topology
from layer_boundary_models import family, model_config
from layer_boundary.cli.oracle import hf_from_state, hf_logits
from layer_boundary.cli.runner import RunJob, run_rank
from layer_boundary.testing.grid import GridSpec

from cp_grid import assert_matches_single_rank, run_cp_grid_rank

pytestmark = pytest.mark.gloo

#: prompt lengths: uneven, none divisible by the CP size, one shorter than the CP size
LENGTHS = (7, 1, 10, 5)
DECODE_STEPS = 2


@functools.lru_cache(maxsize=None)
def case(model: str, weights_dir: str):
    """(job, HF logits, single-rank logits) for `model`, float64, cached per process."""
    config = model_config(model)
    state = family(model).random_weights(config, torch.float64, seed=11)
    path = f"{weights_dir}/{model}-cp.pt"
    torch.save(state, path)
    gen = torch.Generator().manual_seed(5)
    prompts = tuple(tuple(torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()) for n in LENGTHS)
    decode = tuple(tuple(torch.randint(0, config.vocab_size, (len(LENGTHS),), generator=gen).tolist()) for _ in range(DECODE_STEPS))
    hf = hf_from_state(dict(config.hf), state, torch.float64)
    ref = hf_logits(hf, [torch.tensor(p) for p in prompts], decode)
    job = RunJob(
        model=model, hf_config=dict(config.hf), topology=Topology(), reduction="ar", dtype="float64",
        weights=path, prompts=prompts, decode_tokens=decode,
    )
    single = run_rank(Parallel.single(), job)["logits"]
    return job, ref, [single[r] for r in range(len(prompts))]


def rel_error(logits: dict, ref) -> float:
    assert sorted(logits) == list(range(len(ref)))
    worst = scale = 0.0
    for r, steps in enumerate(ref):
        assert len(logits[r]) == len(steps) == 1 + DECODE_STEPS
        for ours, theirs in zip(logits[r], steps):
            theirs = theirs.double().reshape(ours.shape)
            worst = max(worst, (ours.double() - theirs).abs().max().item())
            scale = max(scale, theirs.abs().max().item())
    return worst / scale


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cp-weights"))


@pytest.mark.parametrize(
    "model, topology, reduction, order",
    [
        ("qwen3", Topology(tp=2, attn_cp=2), "ar", "zigzag"),
        ("qwen3_moe", Topology(tp=2, attn_cp=2), "rs+rsv", "contiguous"),
        ("qwen3", Topology(tp=4, attn_cp=2), "rs+rsv", "contiguous"),
        ("qwen3_moe", Topology(tp=4, attn_cp=2), "rs+rsv", "zigzag"),
        ("qwen3_moe", Topology(tp=4, attn_dp=2, attn_cp=2), "rs+rsv", "zigzag"),
    ],
    ids=["qwen3-cp2", "qwen3_moe-cp2", "qwen3-cp2xtp2", "qwen3_moe-cp2xtp2", "qwen3_moe-dp2xcp2"],
)
def test_cp_prefill_matches_hf_and_a_single_rank(gloo_world, weights_dir, model, topology, reduction, order):
    job, ref, single = case(model, weights_dir)
    job = attrs.evolve(job, topology=topology, reduction=reduction, options={"cp_order": order})
    results = gloo_world(topology.world_size).run(run_rank, topology, job)
    logits = {}
    for res in results:
        logits.update(res["logits"])
    assert rel_error(logits, ref) < 1e-10
    assert rel_error(logits, single) < 1e-12
    counts = results[0]["collectives"]
    # prefill is a CP batch (per layer: the KV gather and the FFN input gather; then the final rows)
    assert counts["prefill"]["all_gatherv@attn_cp"] == 2 * job_layers(job) + 1
    if reduction == "rs+rsv" and topology.attn_dp == 1:
        assert counts["prefill"]["reduce_scatterv@tp"] == job_layers(job)
    # decode is ordinary: nothing over attention CP
    assert not any("attn_cp" in key for key in counts["decode1"])


def job_layers(job) -> int:
    return model_config(job.model, job.hf_config).num_layers


@pytest.mark.parametrize("world, topology, policy", [(2, Topology(tp=2, attn_cp=2), "ar"), (4, Topology(tp=4, attn_cp=2), "rs+rsv")])
def test_grid_stack_under_gloo_is_bit_exact(gloo_world, world, topology, policy):
    spec = GridSpec(
        stages=("shard_attn", "ffn", "attn", "tail", "shard_mixer", "mixer", "ffn", "mixer", "shard_attn", "moe"),
        transforms=(0, 3, 6),
        seed=5,
    )
    lengths = (5, 1, 7, 3)
    results = gloo_world(world).run(run_cp_grid_rank, topology, spec, lengths, policy=policy, captures=(0, 2))
    assert_matches_single_rank(results, spec, sum(lengths), captures=(0, 2))
