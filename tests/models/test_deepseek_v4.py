"""The DeepSeek-V4 reference model (mHC residual) against Hugging Face, prefill + decode.

Hugging Face computes the mHC projections in float32 even in a float64 model, and the rounding of
that float32 GEMM changes with the row count of the batch and the CPU thread count. So float64
runs of several requests per rank agree with HF to ~2e-7 (`FLOAT64_TOLERANCE`), while runs whose
ranks see exactly the rows HF sees, on the threads HF used, agree bit for bit.
"""

import json
import subprocess
import sys

import attrs
import pytest

from layer_boundary import MissingPluginError, Parallel, Topology
from layer_boundary.plugin import ConfigError
from layer_boundary_models import build_model, model_config
from layer_boundary_models.deepseek_v4_family import FLOAT64_TOLERANCE, PRESET
from layer_boundary.cli.runner import run_rank
from layer_boundary.plugin import reset_registry
from layer_boundary.testing.threaded import run_threaded

from model_cases import rel_error, setup

from layer_boundary.testing import requires_plugins

pytestmark = requires_plugins("mhc")

TOLERANCE = {"float64": FLOAT64_TOLERANCE, "float32": 1e-4}


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("deepseek_v4"))


def _run(gloo_world, job, topology):
    if topology.world_size == 1:
        return [run_rank(Parallel.single(), job)]
    return gloo_world(topology.world_size).run(run_rank, topology, job)


@pytest.mark.gloo
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "topology, reduction",
    [(Topology(), "ar"), (Topology(tp=2), "ar"), (Topology(tp=2, attn_dp=2), "rs+rsv")],
    ids=["tp1", "tp2", "attn-dp2"],
)
def test_matches_hf(gloo_world, weights_dir, dtype, topology, reduction):
    job, ref = setup("deepseek_v4", dtype, weights_dir)
    job = attrs.evolve(job, topology=topology, reduction=reduction)
    assert rel_error(_run(gloo_world, job, topology), ref) < TOLERANCE[dtype]


@pytest.mark.gloo
@pytest.mark.parametrize(
    "dtype, batch, topology, kwargs",
    [
        ("float64", 1, Topology(tp=2, attn_dp=2), dict(reduction="ar")),  # DP rank 1 has no rows
        ("float64", 4, Topology(tp=4, attn_dp=2, moe_ep=2), dict(reduction="rs+rsv", dp_padding="max_len")),
        ("float64", 4, Topology(tp=4), dict(reduction="ar")),  # each rank holds half an output group
        ("float32", 4, Topology(tp=2), dict(reduction="rs+rsv", sequence_parallel=True)),
    ],
    ids=["dp2-zero-rows", "dp2xtp2-ep2", "tp4-half-groups", "tp2-sequence-parallel"],
)
def test_more_layouts_match_hf(gloo_world, weights_dir, dtype, batch, topology, kwargs):
    job, ref = setup("deepseek_v4", dtype, weights_dir, batch=batch)
    job = attrs.evolve(job, topology=topology, **kwargs)
    assert rel_error(_run(gloo_world, job, topology), ref) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    "batch, topology",
    [(1, Topology(tp=2)), (2, Topology(tp=2, attn_dp=2)), (1, Topology(tp=4, attn_dp=2))],
    ids=["tp2", "dp2", "dp2xtp2-zero-rows"],
)
def test_bit_exact_when_ranks_see_hf_rows(weights_dir, batch, topology):
    """One request per DP rank, ranks as threads of this process: the float32 projections see
    HF's rows on HF's threads, and the float64 logits agree to rounding of float64 sums."""
    job, ref = setup("deepseek_v4", "float64", weights_dir, batch=batch)
    job = attrs.evolve(job, topology=topology, reduction="rs+rsv" if topology.attn_dp > 1 else "ar")
    assert rel_error(run_threaded(run_rank, topology, job), ref) < 1e-12


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layer_types=["sliding_attention", "compressed_sparse_attention", "sliding_attention"]), "sliding-window attention only"),
        (dict(mlp_layer_types=["hash_moe", "moe", "moe"]), "no hash_moe"),
        (dict(mlp_bias=True), "mlp_bias=true is not supported"),
        (dict(partial_rotary_factor=0.1), "must be even"),
    ],
)
def test_unsupported_configs_are_rejected(change, message):
    with pytest.raises(ConfigError, match=message):
        model_config("deepseek_v4", {**PRESET, **change})


def test_topologies_that_split_an_output_group_unevenly_are_rejected():
    config = model_config("deepseek_v4", {**PRESET, "num_attention_heads": 6, "o_groups": 3, "moe_intermediate_size": 48})
    config.check_topology(Topology(tp=3))
    with pytest.raises(ConfigError, match="one must divide the other"):
        config.check_topology(Topology(tp=2))


def test_without_the_mhc_plugin_construction_names_it(monkeypatch):
    monkeypatch.setenv("LAYER_BOUNDARY_DISABLE_PLUGINS", "mhc")
    reset_registry()
    try:
        with pytest.raises(MissingPluginError, match="layer-boundary-mhc"):
            build_model(model_config("deepseek_v4"), Parallel.single(), device="meta")
    finally:
        monkeypatch.delenv("LAYER_BOUNDARY_DISABLE_PLUGINS")
        reset_registry()


def test_plan_shows_unfused_completion_before_every_mhc_update():
    from layer_boundary.cli.plan_cmd import build_plans

    _, _, plans = build_plans("deepseek_v4", None, Topology(tp=2), "auto")
    assert len(plans) == 2 * PRESET["num_hidden_layers"] and all("mhc.torch" in p["stage"] for p in plans)
    ffn_entry = plans[1]["variants"]["ordinary"]["entry"]
    assert ffn_entry == ["complete the declared sum unfused, then update and read with RMSNorm"]


@pytest.mark.gloo
def test_cli_runs_the_model_and_checks_it_against_hf():
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "run", "--model", "deepseek_v4", "--tp", "2", "--attn-dp", "2",
         "--dtype", "float64", "--decode-steps", "2", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["check"]["tolerance"] == FLOAT64_TOLERANCE
    assert data["config"]["architecture"] == "DeepseekV4ForCausalLM"
    # per layer: the FFN input gathers over DP, its output reduce-scatters back (no attention-TP sum at attn_tp=1)
    layers = PRESET["num_hidden_layers"]
    assert data["collectives"]["decode_step"] == {"all_gatherv@attn_dp": layers, "reduce_scatterv@tp": layers}


def test_cli_without_the_plugin_is_one_line_before_any_rank_starts():
    env = {**__import__("os").environ, "LAYER_BOUNDARY_DISABLE_PLUGINS": "mhc"}
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "run", "--model", "deepseek_v4", "--tp", "2"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "layer-boundary-mhc" in lines[0] and "spawning" not in out.stderr, out.stderr
