"""`layer-boundary run --lora N` from the outside."""

import json
import subprocess
import sys

import pytest


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.gloo
@pytest.mark.oracle
def test_run_with_adapters_matches_peft():
    out = cli("run", "--model", "qwen3", "--tp", "2", "--lora", "3", "--dtype", "float64", "--decode-steps", "1", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["check"]["rel_err"] < 1e-10


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "qwen3_moe", "--lora", "2"], "--lora: model 'qwen3_moe' does not support it (its options: fp8, tbo); --lora runs with: qwen3"),
        (["--model", "qwen3", "--lora", "-1"], "argument --lora: must be >= 0, got -1; pass 0 or more"),
    ],
)
def test_lora_usage_errors_are_one_line(args, message):
    out = cli("run", *args)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr


def test_plan_shows_where_rows_are_published_and_that_lora_sums_wait_for_a_provider():
    out = cli("plan", "--model", "qwen3", "--tp", "2", "--attn-dp", "2", "--lora", "2", "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["boundaries"]
    ffn = next(p for p in plans if p["label"] == "layer0.1:ffn")["variants"]["ordinary"]
    assert ffn["entry"][-1] == "publish the compute rows (dp_gathered) to lora (adapter ids all_gatherv@attn_dp once per forward)"
    attn = next(p for p in plans if p["label"] == "layer1.0:attention")["variants"]["ordinary"]
    assert attn["entry"][-1] == "publish the compute rows (dp_local) to lora"
    tp_only = json.loads(cli("plan", "--model", "qwen3", "--tp", "2", "--lora", "2", "--json").stdout)["boundaries"]
    exit_steps = next(p for p in tp_only if p["label"] == "layer0.1:ffn")["variants"]["ordinary"]["exit"]
    assert exit_steps == ["else compute all-reduces over TP"]  # no provider accepts: the LoRA sum completes in compute
