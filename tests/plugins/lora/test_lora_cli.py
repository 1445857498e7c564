"""`layer-boundary run --lora N` from the outside."""

import json
import subprocess
import sys

import pytest


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.gloo
def test_run_with_adapters_matches_peft():
    out = cli("run", "--model", "qwen3", "--tp", "2", "--lora", "3", "--dtype", "float64", "--decode-steps", "1", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["check"]["rel_err"] < 1e-10


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "qwen3_moe", "--lora", "2"], "model 'qwen3_moe' has no LoRA reference layers; LoRA runs with: qwen3"),
        (["--model", "qwen3", "--lora", "-1"], "--lora takes a number of adapters"),
    ],
)
def test_lora_usage_errors_are_one_line(args, message):
    out = cli("run", *args)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr
