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
    assert result["soak"]["steps"] == 30 and result["soak"]["complete"]
    for r in ranks:
        assert [s["step"] for s in r["samples"]] == [10, 20, 30] and r["steps_done"] == 30 and not r["stopped_early"]
        assert r["before"]["step"] == 0 and r["after_release"]["step"] == 30
        assert r["grew"] == [] and r["growth"]["tensors"] == 0 and r["growth"]["residual_streams"] == 0
        assert r["collectives"]["first"] == r["collectives"]["last"] == {"all_reduce@attn_tp": 4, "all_reduce@tp": 4}
    kill = result["kill"]
    assert kill["ok"] and kill["outcome"] == "error" and kill["victim_reported_dead"] and kill["survivors_raised"], kill
    assert kill["processes_left"] == [] and 0 <= kill["seconds_from_death_to_error"] < 60, kill
    assert "Warning" not in out.stderr


def test_bad_options_are_one_line():
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--steps", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "leaves no sample after the first --window" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.gloo
def test_a_budget_stops_every_rank_at_the_same_sample(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--only", "soak", "--steps", "1000", "--window", "5", "--sample-every", "5",
         "--slots", "2", "--prompt", "4", "--budget-s", "0.001", "--out", str(tmp_path / "soak.json"), "--json"],
        capture_output=True, text=True, timeout=200,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["kill"] is None and result["soak"]["steps"] == 5 and not result["soak"]["complete"]
    assert all(r["stopped_early"] and r["steps_done"] == 5 for r in result["soak"]["ranks"])
    assert "--budget-s 0.001 reached: stopped after 5 of 1000 steps" in out.stderr
