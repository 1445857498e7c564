"""The qwen3_moe reference model with the plugin on (the service, its decisions, its collectives,
the terminal finalize into a Gemma final norm) against the plugin off, on CPU ranks.

The kernels are the float64 references (`testing.reference_kernels`) and the model runs in
float64. Plugin on and off still differ at the 1e-7 level: the core's RMSNorm computes its
statistic in float32 (its `compute_dtype`, as the kernels do for bf16) where the references stay
in float64. A sum missed, doubled or taken over the wrong rows shows up at O(1), far above TOL;
the epsilon and multiplier the fused paths used are checked from the recorded launches.
"""

import pytest
import torch

from layer_boundary.plugin import ConfigError
from layer_boundary_models import family, model_config
from layer_boundary.cli.oracle import reference_of
from layer_boundary import Parallel, Topology
from layer_boundary import GemmaRMSNorm, RMSNorm
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_cutedsl.testing import reference_kernels

from .decoder_driver import MOE_CONFIG, max_rel_diff, requests, run_decoder

DTYPE = torch.float64
TOL = 1e-5


@pytest.fixture(scope="module")
def setup():
    config = model_config("qwen3_moe", MOE_CONFIG)
    state = family("qwen3_moe").random_weights(config, DTYPE, seed=5)
    prompts, decode = requests(config)
    off, _, _ = run_decoder(Parallel.single(), MOE_CONFIG, state, prompts, decode, dtype=DTYPE)
    return config, state, prompts, decode, off


def test_the_gemma_final_norm_option():
    config = model_config("qwen3_moe", MOE_CONFIG)
    assert config.gemma_final_norm and not config.gemma_norm
    from layer_boundary_models import build_model

    model = build_model(config, Parallel.single(), device="meta")
    assert type(model.norm) is GemmaRMSNorm and type(model.layers[0].input_layernorm) is RMSNorm
    state = family("qwen3_moe").random_weights(config, torch.float32, seed=1)
    assert state["model.norm.weight"].abs().mean() < 0.5  # drawn around 0, as (1 + w) wants
    with pytest.raises(ConfigError, match="only qwen3_moe accepts it"):
        model_config("qwen3", dict(model_config("qwen3").hf, layer_boundary_final_norm="gemma"))
    with pytest.raises(ConfigError, match="only qwen3_moe accepts it"):
        model_config("qwen3_moe", dict(MOE_CONFIG, layer_boundary_final_norm="layernorm"))
    with pytest.raises(ConfigError, match="no Hugging Face model has"):
        reference_of(family("qwen3_moe"), config, torch.float32, state=state)


@pytest.mark.parametrize("tp", [1, 2])
def test_plugin_on_matches_plugin_off(setup, tp):
    config, state, prompts, decode, off = setup
    calls = {}

    def rank(parallel):
        mine = calls.setdefault(parallel.rank, [])
        logits, service, model = run_decoder(
            parallel, MOE_CONFIG, state, prompts, decode, dtype=DTYPE, cutedsl={"kernels": reference_kernels(mine)}
        )
        assert model.handoff_norm is service and service.usable and service.group.size == tp
        return logits

    if tp == 1:
        results = [rank(Parallel.single())]
    else:
        results = run_threaded(rank, Topology(tp=tp))
    for logits in results:
        assert max_rel_diff(logits, off) < TOL
    names = [[c[0] for c in calls[r] if c[0] != "prepare"] for r in sorted(calls)]
    assert all(n == names[0] for n in names), "the ranks launched different fused paths"
    steps = 1 + len(decode)
    sparse = len(config.sparse_layers)
    # per step: each MoE layer's finalize is handed off; the one before a next layer goes to that
    # layer's input, the terminal one to the final norm (service.finalize); attention sums (TP > 1)
    if tp == 1:
        assert names[0].count("moe_finalize_add_rmsnorm") == sparse * steps
        assert "moe_finalize" not in names[0] and "fused_add_rmsnorm" not in names[0]
    else:
        assert names[0].count("moe_finalize") == sparse * steps
        # every owed sum met a candidate: MoE finalizes, attention partials, the dense FFN's deferred sum
        attention = config.num_layers
        dense = config.num_layers - sparse
        assert names[0].count("fused_add_rmsnorm") == (sparse + attention + dense) * steps
    final = [c for c in calls[0] if c[0] in ("moe_finalize_add_rmsnorm", "fused_add_rmsnorm")][-1]
    assert final[2]["weight_offset"] == 0.0 and final[2]["eps"] == config.rms_norm_eps  # gamma as applied, the service's eps


def test_without_terminal_finalize_the_final_norm_completes_unfused(setup):
    config, state, prompts, decode, off = setup
    calls = []
    logits, service, model = run_decoder(
        Parallel.single(), MOE_CONFIG, state, prompts, decode, dtype=DTYPE,
        cutedsl={"kernels": reference_kernels(calls), "terminal_finalize": False},
    )
    assert model.handoff_norm is None
    assert max_rel_diff(logits, off) < TOL
    # the last MoE layer completes inside: one fused finalize fewer per step
    fused = [c for c in calls if c[0] == "moe_finalize_add_rmsnorm"]
    assert len(fused) == (len(config.sparse_layers) - 1) * (1 + len(decode))


def test_a_batch_beyond_the_workspace_runs_unfused(setup):
    """max_tokens below the prefill: the prefill defers nothing (on every rank), decode does."""
    config, state, prompts, decode, off = setup
    calls = []
    logits, _, _ = run_decoder(
        Parallel.single(), MOE_CONFIG, state, prompts, decode, dtype=DTYPE,
        cutedsl={"kernels": reference_kernels(calls), "max_tokens": len(prompts)},
    )
    assert max_rel_diff(logits, off) < TOL
    tokens = [c[1] for c in calls if c[0] == "moe_finalize_add_rmsnorm"]
    assert tokens and set(tokens) == {len(prompts)}  # decode steps only
