"""benchmarks/gpu_soak.py in its CPU mode (gloo ranks, the tiny Qwen3, a few windows), so the
GPU soak the lead runs on the H200 cannot rot: the soak's samples show no growth, and the rank
killed mid-forward ends in an error on the others within seconds."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_soak.py"


@pytest.mark.gloo
def test_the_soak_script_runs_on_cpu_ranks(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "30", "--window", "10", "--sample-every", "10",
         "--slots", "3", "--prompt", "5", "--kill-deadline", "60", "--out", str(tmp_path / "soak.json"), "--json"],
        capture_output=True, text=True, timeout=280,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert json.loads((tmp_path / "soak.json").read_text()) == result
    ranks = result["soak"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert [s["step"] for s in r["samples"]] == [10, 20, 30]
        assert r["grew"] == [] and r["growth"]["tensors"] == 0 and r["growth"]["residual_streams"] == 0
        assert r["collectives"]["first"] == r["collectives"]["last"] == {"all_reduce@attn_tp": 4, "all_reduce@tp": 4}
    kill = result["kill"]
    assert kill["ok"] and kill["outcome"] == "error" and kill["victim_reported_dead"] and kill["survivors_raised"], kill
    assert "Warning" not in out.stderr


def test_bad_options_are_one_line():
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "leaves no sample after the first --window" in out.stderr and len(out.stderr.strip().splitlines()) == 1
