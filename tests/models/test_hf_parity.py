"""Reference models through the boundaries vs Hugging Face, on real gloo ranks."""

import attrs
import pytest

from layer_boundary import Parallel, Topology
from layer_boundary.cli.runner import run_rank

from model_cases import TOLERANCE, rel_error, setup

pytestmark = pytest.mark.gloo

TOPOLOGIES = {
    "tp2": Topology(tp=2),
    "tp4": Topology(tp=4),
    "dp2xtp2": Topology(tp=4, attn_dp=2),
    "dp2": Topology(tp=2, attn_dp=2),
}


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("weights"))


def _run(gloo_world, job, topology):
    if topology.world_size == 1:
        return [run_rank(Parallel.single(), job)]
    return gloo_world(topology.world_size).run(run_rank, topology, job)


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("topo", ["tp1", "tp2", "tp4", "dp2xtp2"])
def test_matches_hf_in_float64(gloo_world, weights_dir, model, topo):
    job, ref = setup(model, "float64", weights_dir)
    topology = TOPOLOGIES.get(topo, Topology())
    job = attrs.evolve(job, topology=topology, reduction="rs+rsv" if "dp" in topo else "ar")
    assert rel_error(_run(gloo_world, job, topology), ref) < TOLERANCE["float64"]


@pytest.mark.parametrize("policy", ["ar", "rs", "rsv", "rs+rsv"])
@pytest.mark.parametrize("padding", ["sum_len", "max_len"])
def test_every_policy_under_attention_dp(gloo_world, weights_dir, policy, padding):
    job, ref = setup("qwen3_moe", "float64", weights_dir)
    topology = TOPOLOGIES["dp2xtp2"]
    job = attrs.evolve(job, topology=topology, reduction=policy, dp_padding=padding)
    assert rel_error(_run(gloo_world, job, topology), ref) < TOLERANCE["float64"]


@pytest.mark.parametrize(
    "model, topology, kwargs",
    [
        ("qwen3", Topology(tp=2), dict(reduction="ar")),
        ("qwen3_moe", Topology(tp=4, moe_ep=2), dict(reduction="ar")),
        ("qwen3_moe", Topology(tp=4, moe_ep=4, attn_dp=2), dict(reduction="rs+rsv")),
        ("qwen3", Topology(tp=4), dict(reduction="rs+rsv", sequence_parallel=True)),
        ("qwen3_moe", Topology(tp=2, attn_dp=2), dict(reduction="rsv")),
    ],
    ids=["qwen3-tp2", "moe-ep2", "moe-ep4-dp2", "qwen3-sp", "moe-dp2-tp1"],
)
def test_matches_hf_in_float32(gloo_world, weights_dir, model, topology, kwargs):
    job, ref = setup(model, "float32", weights_dir)
    job = attrs.evolve(job, topology=topology, **kwargs)
    assert rel_error(_run(gloo_world, job, topology), ref) < TOLERANCE["float32"]


def test_gemma_norm_variant_matches_hf(gloo_world, weights_dir):
    job, ref = setup("gemma", "float64", weights_dir)
    job = attrs.evolve(job, topology=TOPOLOGIES["tp4"])  # 1 KV head replicated over 4 ranks
    assert rel_error(_run(gloo_world, job, TOPOLOGIES["tp4"]), ref) < TOLERANCE["float64"]


def test_a_wrong_sum_fails_the_check(gloo_world, weights_dir):
    """The oracle comparison is sensitive: dropping one rank's partial sum is caught."""
    job, ref = setup("qwen3", "float64", weights_dir)
    wrong = attrs.evolve(job, topology=Topology(tp=2))
    results = _run(gloo_world, wrong, Topology(tp=2))
    assert rel_error(results, ref) < TOLERANCE["float64"]
    single = run_rank(Parallel.single(), attrs.evolve(job, weights=job.weights, hf_config={**job.hf_config, "num_hidden_layers": 3}))
    broken = [{**results[0], "logits": single["logits"]}]
    assert rel_error(broken, ref) > 1e-3
