"""The sandwich-norm families (gemma2, gemma3) through the boundaries vs Hugging Face, in the
threaded world: every topology, prefill and decode, in float64; each feature of the test
configs bends the logits (so the parity tests would see it missing); bad configs fail at parse
or construction naming the field."""

import functools
import json
import subprocess
import sys

import attrs
import pytest
import torch

from layer_boundary import Parallel, Topology
from layer_boundary.cli.plan_cmd import PlanningCollectives
from layer_boundary.plugin import ConfigError
from layer_boundary_models import build_model, family, model_config
from layer_boundary.cli.oracle import hf_from_state
from layer_boundary.cli.runner import run_rank
from layer_boundary.testing.threaded import run_threaded

from model_cases import TOLERANCE, rel_error, setup

FAMILIES = ("gemma2", "gemma3")

#: (topology, reduction, sequence parallel): TP 2 and 4 (4 replicates gemma's 2 KV heads),
#: attention DP with and without attention TP, pipeline stages, and the sequence-parallel path
TOPOLOGIES = {
    "tp2": (Topology(tp=2), "ar", False),
    "tp4": (Topology(tp=4), "ar", False),
    "dp2xtp2": (Topology(tp=4, attn_dp=2), "rs+rsv", False),
    "dp2": (Topology(tp=2, attn_dp=2), "rsv", False),
    "tp2-pp2": (Topology(tp=2, pp=2), "ar", False),
    "dp2-pp2": (Topology(tp=2, attn_dp=2, pp=2), "rs+rsv", False),
    "tp2-sp": (Topology(tp=2), "rs+rsv", True),
}


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sandwich-weights"))


@functools.lru_cache(maxsize=None)
def _single_rank(model: str, weights_dir: str) -> list:
    """One rank's logits in the reference's layout (per request, per step)."""
    job, ref = setup(model, "float64", weights_dir)
    logits = run_rank(Parallel.single(), job)["logits"]
    return [logits[r] for r in range(len(ref))]


@pytest.mark.parametrize("model", FAMILIES)
def test_single_rank_matches_hf_in_float64(weights_dir, model):
    job, ref = setup(model, "float64", weights_dir)
    assert max(len(p) for p in job.prompts) > model_config(model).sliding_window  # the window cuts into every prefill
    assert rel_error([{"logits": dict(enumerate(_single_rank(model, weights_dir)))}], ref) < TOLERANCE["float64"]


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_sharded_runs_match_hf_and_one_rank_in_float64(weights_dir, model, topo):
    topology, reduction, sequence_parallel = TOPOLOGIES[topo]
    job, ref = setup(model, "float64", weights_dir)
    job = attrs.evolve(job, topology=topology, reduction=reduction, sequence_parallel=sequence_parallel)
    results = run_threaded(run_rank, topology, job, timeout=120)
    assert rel_error(results, ref) < TOLERANCE["float64"]
    assert rel_error(results, _single_rank(model, weights_dir)) < TOLERANCE["float64"]
    if topology.pp > 1:  # only the last stage reports
        assert all(not r["logits"] for r in results if r["rank"] < topology.tp * (topology.pp - 1))


def _gemma3_rope(full=None, sliding=None):
    rope = model_config("gemma3").hf["rope_parameters"]
    return {"rope_parameters": {"full_attention": full or rope["full_attention"], "sliding_attention": sliding or rope["sliding_attention"]}}


#: one change per feature of the test configs; without the feature the logits move
FEATURES = {
    "gemma2": {
        "attention soft cap": {"attn_logit_softcapping": None},
        "final soft cap": {"final_logit_softcapping": None},
        "sliding window": {"sliding_window": 64},
        "query_pre_attn_scalar": {"query_pre_attn_scalar": 16},
        "rope base": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}},
    },
    "gemma3": {
        "final soft cap": {"final_logit_softcapping": None},
        "sliding window": {"sliding_window": 64},
        "query_pre_attn_scalar": {"query_pre_attn_scalar": 16},
        "local rope base": _gemma3_rope(sliding={"rope_type": "default", "rope_theta": 1000000.0}),
        "linear rope scaling": _gemma3_rope(full={"rope_type": "default", "rope_theta": 1000000.0}),
    },
}


@pytest.mark.parametrize("model, feature", [(m, f) for m in FAMILIES for f in FEATURES[m]])
def test_every_feature_of_the_test_config_moves_the_logits(weights_dir, model, feature):
    job, ref = setup(model, "float64", weights_dir)
    without = attrs.evolve(job, hf_config={**job.hf_config, **FEATURES[model][feature]})
    assert rel_error([run_rank(Parallel.single(), without)], ref) > 1e-4


@pytest.mark.parametrize(
    "model, change, field",
    [
        ("gemma2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type 'yarn'"),
        ("gemma3", _gemma3_rope(full={"rope_type": "dynamic", "factor": 2.0}), r"rope_parameters\['full_attention'\]: rope_type 'dynamic'"),
        ("gemma3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_parameters: gemma3_text takes one entry per layer type"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma2", {"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries"),
        ("gemma2", {"layer_types": ["chunked_attention"] * 4}, "layer_types has"),
        ("gemma2", {"sliding_window": None}, "sliding_window=None"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"attention_bias": True}, "attention_bias"),
        ("gemma2", {"final_logit_softcapping": 0.0}, "final_logit_softcapping"),
        ("gemma3", {"hidden_activation": "relu"}, "hidden_activation"),
        ("gemma2", {"head_dim": None}, "head_dim"),
    ],
)
def test_a_bad_config_fails_at_parse_naming_the_field(model, change, field):
    with pytest.raises(ConfigError, match=field) as info:
        model_config(model, {**model_config(model).hf, **change})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "model, topology, field",
    [
        ("gemma2", Topology(tp=8), "num_attention_heads=4 is not divisible by attention TP 8"),
        ("gemma3", Topology(tp=2, attn_cp=2), "--attn-cp 1"),
        ("gemma3", Topology(tp=1, pp=8), "--pp 8 is more than the 4 layers"),
    ],
)
def test_a_topology_the_model_cannot_split_fails_at_construction(model, topology, field):
    config = model_config(model)
    parallel = Parallel.create(topology, 0, lambda name, ranks: PlanningCollectives(name, ranks, 0))
    with pytest.raises(ConfigError, match=field) as info:
        build_model(config, parallel, device="meta")
    assert "\n" not in str(info.value)


def test_plan_shows_two_sums_a_layer_each_completed_with_its_post_norm(capsys):
    """`layer-boundary plan --model gemma3 --tp 2`: per layer an attention and an FFN boundary;
    each output leaves its sum and its post-norm to the next input, which completes the sum,
    norms it, adds and reads in one call (the candidates, the core's unfused one last); the MLP
    defers its all-reduce there (the last one, before the final norm, all-reduces in its exit):
    two sums a layer."""
    from layer_boundary.cli.main import main

    assert main(["plan", "--model", "gemma3", "--tp", "2", "--reduction", "ar", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["boundaries"]
    assert [p["label"] for p in plans] == [f"layer{i}.{j}:{kind}" for i in range(4) for j, kind in enumerate(("attention", "ffn"))]
    leaves = "leave the post-norm layer{}.post_{}_layernorm (GemmaRMSNorm) for the next input, which applies it to the completed output"
    for i, (attention, ffn) in enumerate(zip(plans[::2], plans[1::2])):
        assert attention["variants"]["ordinary"]["exit"] == ["leave the ATTN_TP sum (declared) for the next input",
                                                             leaves.format(i, "attention")]
        entry = ffn["variants"]["ordinary"]["entry"]
        assert entry[0].startswith("complete the declared sum through the first accepting candidate") and entry[0].endswith("core.unfused")
        assert entry[1].startswith(f"the producer's post-norm layer{i}.post_attention_layernorm (GemmaRMSNorm) runs here")
        assert ffn["post_norm"].startswith("norm the output with GemmaRMSNorm, add, read with GemmaRMSNorm")
        defer = [] if i == 3 else ["defer the TP all-reduce to the next input when the batch has tokens (fuse_mlp_allreduce)"]
        last = "compute all-reduces over TP" if i == 3 else "else compute all-reduces over TP"
        assert ffn["variants"]["ordinary"]["exit"] == defer + [last, leaves.format(i, "feedforward")]
        if i:
            assert attention["variants"]["ordinary"]["entry"][1].startswith(f"the producer's post-norm layer{i - 1}.post_feedforward")


def test_a_checkpoint_without_a_sandwich_norm_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from layer_boundary.cli.checkpoint import CheckpointError, check_checkpoint

    config = model_config("gemma3")
    hf_from_state(dict(config.hf), family("gemma3").random_weights(config, torch.float32, 1), torch.float32).save_pretrained(tmp_path)
    check_checkpoint(tmp_path, config)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in ("model.layers.1.post_feedforward_layernorm.weight", "model.layers.2.self_attn.k_norm.weight"):
        del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(tmp_path, config)
    assert any("post_feedforward_layernorm" in p for p in info.value.problems)
    assert any("layers.2.self_attn.k_norm" in p for p in info.value.problems)

# the command line, once per family: a save_pretrained() checkpoint run on two gloo ranks -----------


@pytest.mark.gloo
@pytest.mark.oracle
@pytest.mark.parametrize("model", FAMILIES)
def test_run_from_a_saved_checkpoint_matches_hf_at_tp2(tmp_path, model):
    """`layer-boundary run --checkpoint DIR --tp 2 --check hf`: the config.json transformers
    writes parses, the checkpoint passes its check and loads sharded, the logits match HF's
    from_pretrained(); each layer completes two sums (attention's and the MLP's, each before
    its post-norm)."""
    config = model_config(model)
    hf = hf_from_state(dict(config.hf), family(model).random_weights(config, torch.float32, 1), torch.float32)
    hf.save_pretrained(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "run", "--model", model, "--checkpoint", str(tmp_path), "--tp", "2",
         "--check", "hf", "--decode-steps", "2", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["config"]["architecture"] == config.architecture
    layers = config.num_layers
    assert data["collectives"]["decode_step"] == {"all_reduce@attn_tp": layers, "all_reduce@tp": layers}
