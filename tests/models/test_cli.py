"""The main job from the outside: `layer-boundary run` and `plan`, their output and their errors."""

import json
import subprocess
import sys

import pytest
import torch

from layer_boundary_models import model_config
from layer_boundary.cli.oracle import hf_from_state
from layer_boundary_models import family


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.gloo
def test_run_json_reports_check_config_timings_and_collectives():
    out = cli("run", "--model", "qwen3_moe", "--tp", "2", "--dtype", "float64", "--decode-steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    check = data["check"]
    assert check["reference"] == "hf" and check["passed"] is True and check["rel_err"] < 1e-10
    assert data["config"]["topology"]["tp"] == 2 and data["config"]["reduction"] == "rs+rsv"
    assert data["timings"]["prefill_s"] > 0 and data["timings"]["decode_step_s"] > 0 and data["timings"]["tokens_per_s"] > 0
    # 4 layers: one attention sum per layer; the FFN sums defer to the next input except the last
    assert data["collectives"]["decode_step"] == {"all_reduce@attn_tp": 4, "all_reduce@tp": 4}
    assert data["config"]["nodes"] == {"count": 1, "of_rank": [0, 0], "tp_within_a_node": True, "pp_within_a_node": True}
    assert "step/s" not in out.stderr  # --json: no bar


@pytest.mark.gloo
def test_run_human_output_and_single_rank_check():
    out = cli("run", "--model", "gemma", "--tp", "2", "--attn-dp", "2", "--check", "single", "--decode-steps", "1")
    assert out.returncode == 0, out.stderr
    assert "check vs single: PASS" in out.stdout and "collectives per prefill" in out.stdout
    assert "\r" not in out.stderr and "step/s" not in out.stderr  # stderr is a pipe here: no bar


@pytest.mark.gloo
def test_an_fp8_verdict_says_its_tolerance_bounds_the_relative_error():
    """FP8 reads pass on a relative error while the absolute one exceeds the tolerance's value:
    the line says which one the tolerance bounds, and --json names it."""
    out = cli("run", "--fp8", "dynamic", "--decode-steps", "1")
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("check vs hf"))
    assert "PASS  rel err" in line and "< tolerance 1e-01 (relative: max abs err" in line and "/ max |reference logit|" in line, line


def _on_a_terminal(*args, timeout=300):
    """`layer-boundary ARGS` with stderr on a pseudo-terminal (80 columns): (status, stdout, stderr)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "layer_boundary", *args], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the terminal's other end closed: every writer has exited
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    stdout = proc.stdout.read().decode()
    proc.wait(timeout)
    return proc.returncode, stdout, b"".join(chunks).decode(errors="replace")


@pytest.mark.gloo
def test_a_default_run_prints_no_warning_and_draws_a_bar_on_a_terminal():
    """The new user's first command: `layer-boundary run` (qwen3, TP=2 gloo, prefill + 4 decode
    steps) on a terminal. No warning of any kind (torch 2.13 deprecates all_gather_into_tensor
    with a FutureWarning per call) and a progress bar over the 5 steps."""
    status, stdout, stderr = _on_a_terminal("run")
    assert status == 0 and "check vs hf: PASS" in stdout, stdout + stderr
    assert "Warning" not in stderr and "warn" not in stderr.lower(), stderr
    assert "5/5" in stderr and "\r" in stderr, stderr  # redrawn in place


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama"], "unknown model 'llama'"),
        (["--model", "qwen3", "--tp", "3"], "not divisible by attention TP 3"),
        (["--model", "qwen3", "--checkpoint", "/nonexistent"], "--checkpoint /nonexistent: no such folder"),
        (["--model", "qwen3", "--tp", "4", "--attn-dp", "3"], "not divisible by attn_dp"),
        (["--model", "qwen3", "--hf-config", "{not json"], "not valid JSON"),
        (["--model", "qwen3_moe", "--hf-config", '{"model_type": "qwen3"}'], "needs a config with model_type 'qwen3_moe'"),
        (["--model", "qwen3", "--device", "cuda"] if not torch.cuda.is_available() else ["--model", "nope"], "no CUDA device" if not torch.cuda.is_available() else "unknown model"),
        (["--model", "qwen3", "--tp", "1", "--sequence-parallel"], "--sequence-parallel needs attention TP > 1"),
        (["--model", "gemma3", "--hf-config", '{"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}'], "attn_logit_softcapping is set"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(args, message):
    out = cli("run", *args)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr, out.stderr


def test_missing_checkpoint_files_name_the_fix(tmp_path):
    cfg = model_config("qwen3")
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg.hf)))
    out = cli("run", "--model", "qwen3", "--checkpoint", str(tmp_path))
    assert out.returncode == 2 and "no *.safetensors files" in out.stderr


@pytest.mark.gloo
@pytest.mark.oracle
@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
def test_a_checkpoint_saved_by_hf_loads_and_matches(tmp_path, model):
    cfg = model_config(model)
    hf = hf_from_state(dict(cfg.hf), family(model).random_weights(cfg, torch.float32, 1), torch.float32)
    # the MoE as save_pretrained shards it: an index and several files (per-expert tensors)
    hf.save_pretrained(tmp_path, **({"max_shard_size": "200KB"} if model == "qwen3_moe" else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == (model == "qwen3_moe")
    out = cli("run", "--model", model, "--checkpoint", str(tmp_path), "--tp", "2", "--json", "--decode-steps", "2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["check"]["passed"] is True


def test_plan_json_lists_every_boundary_and_variant():
    out = cli("plan", "--model", "qwen3", "--tp", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["boundaries"]) == 8
    first = data["boundaries"][0]
    assert set(first["variants"]) == {"ordinary", "sequence_parallel", "input_scattered"}
    ffn = data["boundaries"][1]
    assert any("core.unfused" in step for step in ffn["variants"]["ordinary"]["entry"])


def test_plan_shows_the_dp_partial_order_under_attention_dp():
    out = cli("plan", "--model", "qwen3_moe", "--tp", "4", "--attn-dp", "2", "--reduction", "rs+rsv")
    assert out.returncode == 0, out.stderr
    assert "all_reduce@tp over the DP-gathered rows" in out.stdout
    assert "reduce_scatter@tp" in out.stdout


def test_plan_bad_input():
    out = cli("plan", "--model", "qwen3", "--tp", "3")
    assert out.returncode == 2 and "not divisible" in out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--decode-steps", "-2"], "layer-boundary run: error: argument --decode-steps: must be >= 0, got -2; pass 0 or more"),
        (["run", "--batch", "0"], "layer-boundary run: error: argument --batch: must be positive, got 0; pass 1 or more"),
        (["run", "--tp", "0"], "argument --tp: must be positive"),
        (["run", "--prompt-tokens", "x"], "argument --prompt-tokens: expected an integer, got 'x'"),
        (["run", "--timeout", "-1"], "argument --timeout: must be a positive number"),
        (["run", "--timeout", "nan"], "argument --timeout: must be a positive number"),
        (["run", "--lora", "-1"], "argument --lora: must be >= 0"),
        (["run", "--seed", "-3"], "argument --seed: must be >= 0"),
        (["plan", "--attn-dp", "0"], "layer-boundary plan: error: argument --attn-dp: must be positive, got 0"),
        (["plan", "--rank", "-1"], "layer-boundary plan: error: argument --rank: must be >= 0"),
        (["bench", "host", "--", "--layers", "0"], "layer-boundary bench host: error: argument --layers: must be positive, got 0"),
        (["bench", "host", "--repeats", "-5"], "argument --repeats: must be positive"),
        (["bench", "decode", "--", "--batches", "8", "0"], "argument --batches: must be positive, got 0"),
    ],
)
def test_numeric_options_are_refused_in_one_line(capsys, args, message):
    """Every numeric option of run, plan and bench, checked by the parser before any work."""
    from layer_boundary.cli.main import main

    try:
        status = main(args)
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and message in lines[0], err


# --- the residual-shape families -----------------------------------------------------------------

#: decode-step collectives of the 4-layer presets at TP 2: OLMo-2 adds its q/k statistic to the
#: attention's sum over attention TP; the parallel residual joins the attention's sum into the MLP's
RESIDUAL_FAMILY_DECODE = {
    "olmo2": {"all_reduce@attn_tp": 8, "all_reduce@tp": 4},
    "gpt_neox": {"all_reduce@tp": 4},
    "cohere": {"all_reduce@tp": 4},
}


@pytest.mark.gloo
@pytest.mark.parametrize("model", list(RESIDUAL_FAMILY_DECODE))
def test_run_checks_the_residual_families_against_hf(model):
    out = cli("run", "--model", model, "--tp", "2", "--check", "hf", "--dtype", "float64", "--decode-steps", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["check"]["reference"] == "hf", data["check"]
    assert data["collectives"]["decode_step"] == RESIDUAL_FAMILY_DECODE[model]


@pytest.mark.parametrize("model", list(RESIDUAL_FAMILY_DECODE))
def test_plan_on_the_residual_family_presets(model):
    out = cli("plan", "--model", model, "--tp", "4", "--attn-dp", "2")
    assert out.returncode == 0, out.stderr
    assert "layer0.0:attention" in out.stdout and "layer3.1:ffn" in out.stdout
    # OLMo-2's q/k statistic: a collective its attention issues, shown as a model-wide line
    assert ("q/k norms over the whole projections" in out.stdout) == (model == "olmo2")


def test_a_residual_family_config_the_models_cannot_run_is_one_line():
    bad = json.dumps({**family("gpt_neox").preset(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})
    out = cli("run", "--model", "gpt_neox", "--hf-config", bad)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "rope_parameters.rope_type='yarn'" in lines[0], out.stderr
