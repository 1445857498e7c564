"""The LongCat-Flash reference model (MoE main line + FFN -> attention -> FFN prepared branch)
against Hugging Face's LongcatFlashForCausalLM, built tiny from the same config and weights.

Prefill logits agree to float64 rounding on every layout. Decode steps agree to ~1e-7: HF routes
in fp32 even in a float64 model and scores one decode row at a time (a CPU GEMV) where a batched
run scores several (a GEMM), and the two round differently; the family's check tolerance says so.
"""

import attrs
import pytest

from layer_boundary import Parallel, Topology
from layer_boundary.plugin import ConfigError
from layer_boundary_models import family, model_config
from layer_boundary.cli.runner import run_rank

from model_cases import setup

from layer_boundary.testing import requires_plugins

pytestmark = requires_plugins("tbo")

MODEL = "longcat_flash"


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("longcat"))


def _errors(results, ref):
    """(relative error of the prefill logits, relative error over every step)."""
    got = {}
    for res in results:
        got.update(res["logits"])
    assert sorted(got) == list(range(len(ref)))
    scale = max(t.abs().max().item() for steps in ref for t in steps)
    prefill = max((got[r][0] - ref[r][0]).abs().max().item() for r in range(len(ref)))
    every = max((a - b).abs().max().item() for r in range(len(ref)) for a, b in zip(got[r], ref[r]))
    return prefill / scale, every / scale


def _run(gloo_world, job, topology):
    if topology.world_size == 1:
        return [run_rank(Parallel.single(), job)]
    return gloo_world(topology.world_size).run(run_rank, topology, job)


CASES = {
    "tp1": (Topology(), "ar", {}),
    "tp2": (Topology(tp=2), "ar", {}),
    "attn-dp2": (Topology(tp=2, attn_dp=2), "rsv", {}),
    "tp2-tbo": (Topology(tp=2), "ar", {"tbo": True}),
    "dp2xtp2-ep2-tbo": (Topology(tp=4, attn_dp=2, moe_ep=2), "rs+rsv", {"tbo": True}),
}


@pytest.mark.gloo
@pytest.mark.parametrize("case", list(CASES))
def test_matches_hf_in_float64(gloo_world, weights_dir, case):
    topology, reduction, options = CASES[case]
    job, ref = setup(MODEL, "float64", weights_dir, steps=2)
    job = attrs.evolve(job, topology=topology, reduction=reduction, options=options)
    prefill, every = _errors(_run(gloo_world, job, topology), ref)
    assert prefill < 1e-10
    assert every < family(MODEL).tolerances["float64"]


@pytest.mark.gloo
def test_matches_hf_in_float32_under_attention_dp(gloo_world, weights_dir):
    job, ref = setup(MODEL, "float32", weights_dir, steps=2)
    topology = Topology(tp=2, attn_dp=2)
    job = attrs.evolve(job, topology=topology, reduction="rs+rsv")
    _, every = _errors(_run(gloo_world, job, topology), ref)
    assert every < 1e-4


def test_a_dropped_shortcut_fails_the_check(weights_dir, monkeypatch):
    """The oracle comparison sees the branch: a layer that skipped its shortcut FFN would fail."""
    from layer_boundary_models import longcat

    job, ref = setup(MODEL, "float64", weights_dir, steps=2)
    monkeypatch.setattr(longcat.TPGatedMLP, "forward", lambda self, x: x.new_zeros(x.shape))
    prefill, _ = _errors([run_rank(Parallel.single(), job)], ref)
    assert prefill > 1e-3


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn' is not supported"),
        ({"router_bias": True}, "router_bias=true is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads must equal num_attention_heads"),
        ({"head_dim": 16}, "must equal qk_rope_head_dim=8"),
    ],
)
def test_unsupported_configs_are_rejected(change, message):
    with pytest.raises(ConfigError, match=message):
        model_config(MODEL, {**model_config(MODEL).hf, **change})


def test_topology_checks_name_the_fix():
    config = model_config(MODEL, {**model_config(MODEL).hf, "n_routed_experts": 6})
    with pytest.raises(ConfigError, match="n_routed_experts=6 is not divisible by moe_ep=4"):
        config.check_topology(Topology(tp=4, moe_ep=4))
    with pytest.raises(ConfigError, match="not divisible by attention TP 8"):
        config.check_topology(Topology(tp=8))
