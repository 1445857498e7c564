"""Checkpoint folders checked before any rank starts: broken files, missing and unexpected
tensors, shapes against the config, dtypes, sharded checkpoints (their index and shards)."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from layer_boundary.plugin import ConfigError
from layer_boundary_models import family, model_config
from layer_boundary.cli.checkpoint import INDEX_FILE, CheckpointError, check_checkpoint
from layer_boundary.cli.oracle import hf_from_state
from layer_boundary.cli.sources import CheckpointSource


def _saved(tmp_path_factory, model, **save):
    folder = tmp_path_factory.mktemp(model)
    cfg = model_config(model)
    hf = hf_from_state(dict(cfg.hf), family(model).random_weights(cfg, torch.float32, 1), torch.float32)
    hf.save_pretrained(folder, **save)
    return folder, cfg


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _saved(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def sharded_moe(tmp_path_factory):
    """qwen3_moe as save_pretrained shards it (per-expert tensors, several files and an index)."""
    return _saved(tmp_path_factory, "qwen3_moe", max_shard_size="200KB")


def _copy(src, dst):
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _problems(folder, cfg):
    with pytest.raises(CheckpointError) as info:
        check_checkpoint(folder, cfg)
    return info.value.problems


def test_a_saved_checkpoint_passes_in_either_expert_layout(qwen3, sharded_moe, tmp_path):
    check_checkpoint(*qwen3)
    check_checkpoint(*sharded_moe)
    # the fused transformers-5 layout (experts.gate_up_proj) in one file passes too
    cfg = sharded_moe[1]
    save_file(family("qwen3_moe").random_weights(cfg, torch.float32, 2), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg.hf)))
    check_checkpoint(tmp_path, cfg)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_file_is_named(qwen3, tmp_path, damage):
    folder, cfg = qwen3
    _copy(folder, tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00\x01not safetensors" * 9, "empty": b""}[damage])
    (problem,) = _problems(tmp_path, cfg)
    assert problem.startswith("model.safetensors: ")
    assert {"truncated": "truncated", "garbage": "not a safetensors file", "empty": "too short"}[damage] in problem
    with pytest.raises(ConfigError, match="model.safetensors"):  # a rank opening it directly names it too
        CheckpointSource(str(tmp_path)).get("model.norm.weight")


def test_shape_mismatches_name_the_tensor_and_both_shapes(qwen3, tmp_path):
    folder, cfg = qwen3
    _copy(folder, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["intermediate_size"] *= 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    doubled = model_config("qwen3", raw)
    problems = _problems(tmp_path, doubled)
    I, H = cfg.intermediate_size, cfg.hidden_size
    assert len(problems) == 3 * cfg.num_layers
    assert problems[0] == (
        f"model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape [{I}, {H}], the config expects [{2 * I}, {H}]"
    )


def test_missing_unexpected_and_surprising_dtype_tensors_one_line_each(qwen3, tmp_path):
    folder, cfg = qwen3
    _copy(folder, tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"]
    state["model.layers.9.mlp.gate_proj.weight"] = torch.zeros(2, 2)  # a layer the config lacks
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"].to(torch.int8)
    state["model.norm.weight"] = state["model.norm.weight"].half()
    state["model.rotary_emb.inv_freq"] = torch.ones(4)  # an old exporter's buffer: ignored
    save_file(state, str(tmp_path / "model.safetensors"))
    problems = _problems(tmp_path, cfg)
    assert problems == [
        "model.safetensors: tensor model.layers.1.self_attn.k_norm.weight is missing; the config expects it",
        "model.safetensors: tensor model.layers.9.mlp.gate_proj.weight is unexpected; "
        "the config has no place for it (a checkpoint of another model or size?)",
        "model.safetensors: tensor model.layers.0.self_attn.q_proj.weight is I8; "
        "the reference models load float tensors (F16, BF16, F32, F64), not quantized or integer ones",
        "model.safetensors: tensor model.norm.weight is F16 where config.json declares F32; re-save the checkpoint in one dtype",
    ]


def test_a_sharded_checkpoint_loads_through_its_index_and_names_the_shard(sharded_moe, tmp_path):
    folder, cfg = sharded_moe
    index = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) >= 3
    source = CheckpointSource(str(folder))
    name = next(n for n, s in index.items() if s == shards[1])
    assert torch.equal(source.require(name), load_file(str(folder / shards[1]))[name])

    broken = _copy(folder, tmp_path)
    (broken / shards[1]).unlink()
    data = (broken / shards[2]).read_bytes()
    (broken / shards[2]).write_bytes(data[: len(data) - 100])
    problems = _problems(broken, cfg)
    count = sum(1 for s in index.values() if s == shards[1])
    assert problems[0] == f"{shards[1]}: missing; {INDEX_FILE} places {count} tensors in it (copy the whole checkpoint)"
    assert problems[1].startswith(f"{shards[2]}: truncated")
    # the tensors of both shards are reported missing, against the index
    assert any(p.startswith(f"{INDEX_FILE}: tensor {name} is missing") for p in problems)
    with pytest.raises(ConfigError, match=shards[1]):
        CheckpointSource(str(broken))


def test_an_index_and_its_shards_disagreeing(sharded_moe, tmp_path):
    folder, cfg = sharded_moe
    broken = _copy(folder, tmp_path)
    raw = json.loads((broken / INDEX_FILE).read_text())
    shards = sorted(set(raw["weight_map"].values()))
    raw["weight_map"]["model.layers.0.mlp.gate.extra"] = shards[0]
    (broken / INDEX_FILE).write_text(json.dumps(raw))
    assert _problems(broken, cfg) == [f"{shards[0]}: tensor model.layers.0.mlp.gate.extra is listed in {INDEX_FILE} but missing from the shard"]
    (broken / INDEX_FILE).write_text("{")
    with pytest.raises(ConfigError, match=f"{INDEX_FILE}: cannot be used"):
        check_checkpoint(broken, cfg)


def test_the_cli_reports_before_spawning_one_line_exit_2(qwen3, tmp_path):
    folder, cfg = qwen3
    _copy(folder, tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "run", "--model", "qwen3", "--checkpoint", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.safetensors: truncated" in lines[0] and "spawning" not in out.stderr, out.stderr


# --- the residual-shape families (olmo2, gpt_neox, cohere) ---------------------------------------


@pytest.mark.parametrize("model", ["olmo2", "gpt_neox", "cohere"])
def test_a_saved_residual_family_checkpoint_passes_and_loads_sharded(tmp_path, model):
    """save_pretrained() folders of OLMo-2, GPT-NeoX and Cohere (tied head): checked, then loaded
    at TP 2 (threaded) they give Hugging Face's logits."""
    from layer_boundary import Topology
    from layer_boundary.cli.oracle import hf_logits
    from layer_boundary.cli.runner import RunJob, make_requests, run_rank
    from layer_boundary.testing import logits_rel_error
    from layer_boundary.testing.threaded import run_threaded

    cfg = model_config(model)
    hf = hf_from_state(dict(cfg.hf), family(model).random_weights(cfg, torch.float64, 1), torch.float64)
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    check_checkpoint(tmp_path, model_config(model, saved))
    prompts, decode = make_requests(cfg.vocab_size, 2, 5, 1, seed=4)
    job = RunJob(model=model, hf_config=saved, topology=Topology(tp=2), reduction="ar", dtype="float64", checkpoint=str(tmp_path),
                 prompts=prompts, decode_tokens=decode)
    ref = hf_logits(hf, [torch.tensor(p) for p in prompts], decode)
    tolerance = max(1e-10, family(model).tolerances.get("float64", 0.0))
    assert logits_rel_error(run_threaded(run_rank, Topology(tp=2), job, timeout=120), ref) < tolerance


def test_gpt_neox_checkpoints_with_the_older_head_name_load(tmp_path):
    """GPT-NeoX checkpoints name the head `embed_out` (transformers renames it on load)."""

    cfg = model_config("gpt_neox")
    state = family("gpt_neox").random_weights(cfg, torch.float32, 2)
    state["embed_out.weight"] = state.pop("lm_head.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg.hf)))
    check_checkpoint(tmp_path, cfg)
    from layer_boundary import Parallel
    from layer_boundary_models import build_model

    model = build_model(cfg, Parallel.single(), dtype=torch.float32)
    family("gpt_neox").load_weights(model, CheckpointSource(str(tmp_path)))
    assert torch.equal(model.lm_head.weight, state["embed_out.weight"])
