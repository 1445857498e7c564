"""Nemotron-H (Mamba-2, attention, MLP and MoE layers, each a single stage) against Hugging Face.

float64 runs reproduce Hugging Face's float32 islands (the scan, the router) request by request,
so the logits agree to ~1e-15; float32 runs to ~1e-6.
"""

import functools
import json
import subprocess
import sys

import attrs
import pytest
import torch

from layer_boundary import Parallel, Topology
from layer_boundary.cli.plan_cmd import PlanningCollectives
from layer_boundary.plugin import Owed
from layer_boundary import BatchVariant
from layer_boundary_models import build_model, family, model_config
from layer_boundary_models.pipeline import pipeline_layers
from layer_boundary.cli.oracle import hf_from_state, hf_logits
from layer_boundary.cli.runner import RunJob, make_requests, run_rank
from layer_boundary import boundaries_of
from layer_boundary.testing.threaded import run_threaded

from model_cases import TOLERANCE, rel_error, setup

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nemotron-weights"))


@functools.lru_cache(maxsize=None)
def _custom(weights_dir: str, dtype: str, prompt: int, **changes):
    """(job, HF logits) for the preset with `changes` to its Hugging Face config."""
    raw = {**family("nemotron_h").preset(), **changes}
    config = model_config("nemotron_h", raw)
    state = family("nemotron_h").random_weights(config, DTYPES[dtype], seed=5)
    path = f"{weights_dir}/nemotron-{dtype}-{abs(hash(tuple(sorted(changes.items()))))}-{prompt}.pt"
    torch.save(state, path)
    prompts, decode = make_requests(config.vocab_size, 4, prompt, 2, seed=9)
    ref = hf_logits(hf_from_state(raw, state, DTYPES[dtype]), [torch.tensor(p) for p in prompts], decode)
    job = RunJob(model="nemotron_h", hf_config=raw, topology=Topology(), reduction="ar", dtype=dtype, weights=path, prompts=prompts, decode_tokens=decode)
    return job, ref


def _gloo(gloo_world, job, topology):
    if topology.world_size == 1:
        return [run_rank(Parallel.single(), job)]
    return gloo_world(topology.world_size).run(run_rank, topology, job)


# --- parity with Hugging Face on real gloo ranks ------------------------------------------------


@pytest.mark.gloo
@pytest.mark.parametrize(
    "topology, reduction",
    [
        (Topology(tp=1), "ar"),
        (Topology(tp=2), "ar"),
        (Topology(tp=2, pp=2), "ar"),  # the preset's two stages meet between two Mamba layers
        (Topology(tp=4, attn_dp=2), "rs+rsv"),
    ],
    ids=["tp1", "tp2", "tp2-pp2", "dp2xtp2"],
)
def test_matches_hf_in_float64(gloo_world, weights_dir, topology, reduction):
    job, ref = setup("nemotron_h", "float64", weights_dir)
    job = attrs.evolve(job, topology=topology, reduction=reduction)
    assert rel_error(_gloo(gloo_world, job, topology), ref) < TOLERANCE["float64"]


@pytest.mark.gloo
def test_a_pipeline_cut_after_a_mixer_before_an_ffn_matches_hf(gloo_world, weights_dir):
    """Layers 0-3 | 4-7: the attention before the MoE leaves its sum declared; the partial
    crosses the pipeline and the receiving MoE layer completes it."""
    job, ref = _custom(weights_dir, "float64", 7, hybrid_override_pattern="M-M*E-MM")
    topology = Topology(tp=2, pp=2)
    assert list(pipeline_layers(8, 2, 1)) == [4, 5, 6, 7]
    assert rel_error(_gloo(gloo_world, attrs.evolve(job, topology=topology), topology), ref) < TOLERANCE["float64"]


@pytest.mark.gloo
def test_matches_hf_in_float32_with_expert_parallel(gloo_world, weights_dir):
    job, ref = setup("nemotron_h", "float32", weights_dir)
    topology = Topology(tp=4, moe_ep=2)
    job = attrs.evolve(job, topology=topology, reduction="ar")
    assert rel_error(_gloo(gloo_world, job, topology), ref) < TOLERANCE["float32"]


# --- more shapes in the threaded world ------------------------------------------------------------


def _threaded(job, topology):
    return run_threaded(run_rank, topology, job, timeout=120)


def test_prompts_shorter_than_the_convolution_and_single_tokens(weights_dir):
    """Prompts of 1-3 tokens: a one-token prefill and convolutions left-padded to the kernel."""
    job, ref = _custom(weights_dir, "float64", 2)
    assert sorted(len(p) for p in job.prompts) == [1, 1, 2, 3]
    topology = Topology(tp=2)
    assert rel_error(_threaded(attrs.evolve(job, topology=topology), topology), ref) < TOLERANCE["float64"]


def test_latent_moe_and_tied_embeddings(weights_dir):
    job, ref = _custom(weights_dir, "float64", 6, moe_latent_size=32, tie_word_embeddings=True)
    topology = Topology(tp=2, moe_ep=2)
    assert rel_error(_threaded(attrs.evolve(job, topology=topology), topology), ref) < TOLERANCE["float64"]


def test_three_pipeline_stages(weights_dir):
    job, ref = setup("nemotron_h", "float64", weights_dir)
    topology = Topology(tp=1, pp=3)
    results = _threaded(attrs.evolve(job, topology=topology), topology)
    assert [bool(r["logits"]) for r in results] == [False, False, True]  # only the last stage reports
    assert rel_error(results, ref) < TOLERANCE["float64"]


def test_pipeline_stages_cover_every_layer_once():
    for n in range(1, 12):
        for pp in range(1, n + 1):
            layers = [i for s in range(pp) for i in pipeline_layers(n, pp, s)]
            assert layers == list(range(n)) and all(len(pipeline_layers(n, pp, s)) for s in range(pp))


# --- the boundaries the model builds --------------------------------------------------------------


def _plans(topology, rank=0, pattern=None):
    raw = dict(family("nemotron_h").preset())
    if pattern:
        raw["hybrid_override_pattern"] = pattern
    config = model_config("nemotron_h", raw)
    parallel = Parallel.create(topology, rank, lambda name, ranks: PlanningCollectives(name, ranks, rank))
    return [b.plan for b in boundaries_of(build_model(config, parallel, reduction="rs+rsv", device="meta"))]


@pytest.mark.parametrize("topology", [Topology(tp=2), Topology(tp=4, attn_dp=2), Topology(tp=1)], ids=["tp2", "dp2xtp2", "tp1"])
def test_every_layer_is_one_stage_and_neighbours_agree(topology):
    pattern = "MM*-E*ME--EM*"
    plans = _plans(topology, pattern=pattern)
    assert len(plans) == len(pattern)
    for kind, plan in zip(pattern, plans):
        assert plan.kind.value == ("mixer" if kind in "M*" else "ffn")
        assert plan.declaration.sparse is (kind == "E")
        if kind in "M*":  # mixers take no input gathered over attention TP: no SP/IS paths
            assert set(plan.paths) == {BatchVariant.ORDINARY}
    for left, right in zip(plans, plans[1:]):
        assert left.declaration.following.facts() == right.declaration.facts()
        assert right.declaration.previous.facts() == left.declaration.facts()
        exit_path = left.paths[BatchVariant.ORDINARY].exit
        entry = right.paths[BatchVariant.ORDINARY].entry
        assert (entry.owed is Owed.DECLARED) is exit_path.leaves_declared
        if exit_path.may_defer:
            assert entry.owed is Owed.DYNAMIC
        if left.kind.value == "mixer":
            # before an FFN always left; before a mixer deferred only without attention DP
            assert exit_path.leaves_declared is (right.kind.value == "ffn")
            assert exit_path.may_defer is (right.kind.value == "mixer" and topology.attn_dp == 1 and topology.attn_tp > 1)
    assert plans[-1].terminal and not plans[-1].paths[BatchVariant.ORDINARY].exit.may_defer


def test_pipeline_stages_build_only_their_layers_with_the_real_neighbours():
    topology = Topology(tp=2, pp=2)
    first, second = _plans(topology, rank=0), _plans(topology, rank=2)
    assert [p.label for p in first] == [f"layer{i}:{k}" for i, k in enumerate("M-ME*M")]
    assert [p.label for p in second] == [f"layer{i}:{k}" for i, k in zip(range(6, 11), "M*E-M")]
    assert first[-1].declaration.following.facts() == second[0].declaration.facts()
    assert not first[-1].terminal and second[-1].terminal
    assert first[-1].paths[BatchVariant.ORDINARY].exit.may_defer  # mixer -> mixer across the cut


# --- the command line -----------------------------------------------------------------------------


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.gloo
def test_run_with_a_pipeline_split_reports_the_check_and_the_handoff():
    out = cli("run", "--model", "nemotron_h", "--tp", "2", "--pp", "2", "--dtype", "float64", "--decode-steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["check"]["rel_err"] < 1e-10
    assert data["config"]["topology"]["pp"] == 2 and data["config"]["layers"] == 11
    # rank 0 holds layers 0-5: M-ME*M, then hands off once per step
    assert data["collectives"]["decode_step"] == {"all_gather@pp": 1, "all_reduce@attn_tp": 4, "all_reduce@tp": 2}


def test_plan_shows_each_layer_with_its_neighbours():
    out = cli("plan", "--model", "nemotron_h", "--tp", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = [(b["label"], b["producer"], b["consumer"]) for b in data["boundaries"]]
    # an FFN before a sparse one says so (next_sparse: where a two-batch-overlap split may start)
    assert rows[:3] == [("layer0:M", "stack input", "ffn[next_sparse]"), ("layer1:-", "mixer", "mixer"),
                        ("layer2:M", "ffn[next_sparse]", "ffn[sparse,next_sparse]")]
    assert rows[-1] == ("layer10:M", "ffn", "final norm")
    mixer_to_mixer = data["boundaries"][5]["variants"]["ordinary"]["exit"]
    assert any("defer the ATTN_TP all-reduce" in step for step in mixer_to_mixer)
    out = cli("plan", "--model", "nemotron_h", "--tp", "2", "--pp", "2", "--rank", "2")
    assert out.returncode == 0 and "layer6:M" in out.stdout and "layer5:M" not in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nemotron_h", "--tp", "4", "--hf-config", json.dumps({**family("nemotron_h").preset(), "n_groups": 2})], "n_groups=2 is not divisible by attention TP 4"),
        (["--model", "deepseek_v4", "--tp", "1", "--pp", "2"], "deepseek_v4 runs without pipeline stages"),
        (["--model", "qwen3", "--pp", "5"], "--pp 5 is more than the 4 layers"),
        (["--model", "nemotron_h", "--pp", "12"], "more than the 11 layers"),
        (["--model", "nemotron_h", "--attn-cp", "2", "--tp", "2"], "context parallel is not supported for Mamba mixers"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(args, message):
    out = cli("run", *args)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.gloo
@pytest.mark.oracle
def test_a_checkpoint_saved_by_hf_loads_and_matches(tmp_path):
    config = model_config("nemotron_h")
    state = family("nemotron_h").random_weights(config, torch.float32, 1)
    hf_from_state(dict(config.hf), state, torch.float32).save_pretrained(tmp_path)
    assert len(json.loads((tmp_path / "config.json").read_text())["layers_block_type"]) == 11  # HF saves the list
    out = cli("run", "--model", "nemotron_h", "--checkpoint", str(tmp_path), "--tp", "2", "--json", "--decode-steps", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["check"]["passed"] is True
