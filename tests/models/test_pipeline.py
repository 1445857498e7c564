"""Pipeline stages of the decoder models (qwen3, qwen3_moe, gemma): each stage builds only its
layers, the residual stream crosses each cut once per step, and the logits match Hugging Face."""

import json
import subprocess
import sys

import attrs
import pytest

from layer_boundary import Topology
from layer_boundary.cli.plan_cmd import build_plans
from layer_boundary.cli.runner import run_rank
from layer_boundary.testing.threaded import run_threaded

from model_cases import TOLERANCE, rel_error, setup


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipeline-weights"))


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe", "gemma"])
@pytest.mark.parametrize(
    "topology, reduction",
    [
        (Topology(tp=1, pp=4), "ar"),  # a stage per layer: three cuts
        (Topology(tp=2, pp=2), "ar"),
        (Topology(tp=4, attn_dp=2, pp=2), "rs+rsv"),
    ],
    ids=["tp1-pp4", "tp2-pp2", "dp2xtp2-pp2"],
)
def test_pipeline_stages_match_hf_in_float64(weights_dir, model, topology, reduction):
    job, ref = setup(model, "float64", weights_dir)
    job = attrs.evolve(job, topology=topology, reduction=reduction)
    results = run_threaded(run_rank, topology, job, timeout=120)
    assert rel_error(results, ref) < TOLERANCE["float64"]
    assert all(not r["logits"] for r in results if r["rank"] < topology.tp * (topology.pp - 1))  # only the last stage reports


def test_each_stage_builds_its_layers_and_the_edge_is_described_alike():
    _, _, first = build_plans("gemma", None, Topology(tp=2, pp=2), "ar", rank=0)
    _, _, second = build_plans("gemma", None, Topology(tp=2, pp=2), "ar", rank=2)
    assert [p["label"] for p in first] == ["layer0.0:attention", "layer0.1:ffn", "layer1.0:attention", "layer1.1:ffn"]
    assert [p["label"] for p in second] == ["layer2.0:attention", "layer2.1:ffn", "layer3.0:attention", "layer3.1:ffn"]
    # across the cut: the sender's last FFN leaves for a next stage, the receiver's attention enters from an FFN
    assert (first[-1]["stage"], first[-1]["consumer"]) == ("ffn", "next stage")
    assert (second[0]["stage"], second[0]["producer"]) == ("attention", "ffn")


@pytest.mark.gloo
def test_run_with_pipeline_stages_in_float16():
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "run", "--model", "qwen3_moe", "--tp", "2", "--pp", "2",
         "--dtype", "float16", "--decode-steps", "2", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] and data["check"]["rel_err"] < 1e-2 and data["config"]["dtype"] == "float16"
    assert data["config"]["topology"]["pp"] == 2 and data["collectives"]["decode_step"]["all_gather@pp"] == 1
