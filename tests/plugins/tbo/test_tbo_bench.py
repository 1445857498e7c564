"""`layer-boundary bench tbo` in its CPU mode (two gloo ranks, a small qwen3): the benchmark the
GPU machine runs checks TBO against the whole batch, times every mode and writes its JSON, so it
cannot rot between GPU runs."""

import json
import subprocess
import sys

import pytest

SMALL = ["--device", "cpu", "--gpus", "2", "--dtype", "float32", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
         "--intermediate", "128", "--layers", "2", "--vocab", "128", "--requests", "2", "--tokens-per-request", "4",
         "--warmup", "0", "--iters", "1"]


@pytest.mark.gloo
def test_the_tbo_bench_runs_on_cpu_ranks(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "bench", "tbo", "--json", "--", *SMALL, "--out", str(tmp_path / "tbo.json")],
        capture_output=True, text=True, timeout=280,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert json.loads((tmp_path / "tbo.json").read_text()) == result
    assert result["check_max_rel_diff"] < 1e-4
    assert set(result["step_ms"]) == {"whole", "half0", "half1", "tbo-1stream", "tbo-2streams"}
    assert [r["rank"] for r in result["results"]] == [0, 1]
    assert "a CPU dry run" in out.stderr


@pytest.mark.parametrize(
    "options, message",
    [(["--requests", "3"], "--requests must be even"), (["--iters", "0"], "argument --iters: must be positive, got 0")],
)
def test_bad_options_are_refused_in_one_line(capsys, options, message):
    from layer_boundary.cli.main import main

    status = main(["bench", "tbo", "--", *options])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("layer-boundary bench tbo: error: ") and message in lines[0]
