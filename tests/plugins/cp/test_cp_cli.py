"""`layer-boundary run --attn-cp` from the outside: a CP prefill checked against HF, and one-line
errors (exit status 2) for what it cannot run."""

import json
import os
import subprocess
import sys

import pytest


def cli(*args, env=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, timeout=300, env=full_env)


def one_line_error(out) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.gloo
def test_run_with_attention_cp_matches_hf():
    out = cli("run", "--model", "qwen3_moe", "--tp", "2", "--attn-cp", "2", "--cp-order", "contiguous", "--dtype", "float64",
              "--prompt-tokens", "6", "--decode-steps", "1", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["check"]["rel_err"] < 1e-10
    assert data["config"]["topology"]["attn_cp"] == 2 and data["config"]["cp_order"] == "contiguous"
    assert data["collectives"]["prefill"]["all_gatherv@attn_cp"] == 2 * data["config"]["layers"] + 1
    assert "all_gatherv@attn_cp" not in data["collectives"]["decode_step"]


def test_without_the_plugin_attn_cp_names_the_distribution():
    line = one_line_error(cli("run", "--model", "qwen3", "--tp", "2", "--attn-cp", "2", env={"LAYER_BOUNDARY_DISABLE_PLUGINS": "cp"}))
    assert "--attn-cp 2" in line and "pip install layer-boundary-cp" in line


def test_cp_with_sequence_parallel_is_refused():
    line = one_line_error(cli("run", "--model", "qwen3", "--tp", "4", "--attn-cp", "2", "--sequence-parallel"))
    assert "--sequence-parallel needs attention TP > 1 and no attention DP or CP" in line


def test_plan_shows_the_cp_variant_of_every_boundary():
    out = cli("plan", "--model", "qwen3", "--tp", "4", "--attn-cp", "2", "--json")
    assert out.returncode == 0, out.stderr
    boundaries = json.loads(out.stdout)["boundaries"]
    assert len(boundaries) == 8 and all(set(b["variants"]) == {"ordinary", "context_parallel"} for b in boundaries)
    assert any("all_gatherv@attn_cp" in step for step in boundaries[1]["variants"]["context_parallel"]["entry"])
