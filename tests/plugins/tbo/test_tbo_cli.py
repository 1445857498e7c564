"""`layer-boundary run --tbo` from the outside."""

import json
import os
import subprocess
import sys

import pytest


def cli(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "layer_boundary", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@pytest.mark.gloo
def test_run_tbo_for_qwen3_moe_passes_against_hf_and_doubles_the_collectives():
    out = cli("run", "--model", "qwen3_moe", "--tp", "2", "--dtype", "float64", "--decode-steps", "2", "--tbo", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["check"]["passed"] is True and data["check"]["rel_err"] < 1e-10
    assert data["config"]["tbo"] is True
    # 3 requests decode as microbatches of 2 and 1 requests: every layer's sums run once per microbatch
    assert data["collectives"]["decode_step"] == {"all_reduce@attn_tp": 8, "all_reduce@tp": 8}


@pytest.mark.gloo
def test_run_tbo_checks_against_the_serial_single_rank():
    out = cli("run", "--model", "qwen3_moe", "--tp", "2", "--attn-dp", "2", "--dtype", "float64", "--decode-steps", "1", "--tbo", "--check", "single")
    assert out.returncode == 0, out.stderr
    assert "check vs single: PASS" in out.stdout


def test_run_tbo_without_the_plugin_is_one_line_and_exit_status_2():
    out = cli("run", "--model", "qwen3_moe", "--tbo", env={"LAYER_BOUNDARY_DISABLE_PLUGINS": "tbo"})
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "--tbo needs the layer-boundary-tbo distribution" in lines[0] and "pip install layer-boundary-tbo" in lines[0]
