"""TBO on CUDA: one stream per microbatch, still bit-exact; NCCL on two GPUs; the overlap script.

Run on the GPU machine (`layer-boundary bench tbo` is the overlap benchmark):
    python -m pytest -q -m gpu tests/plugins/tbo/test_tbo_gpu.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from layer_boundary import Forward, Parallel, Topology, residual_batch, two_batch_overlap

from tbo_exact_stack import ExactStack, inputs_of, reference, rows_of, run_exact_rank, split_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYERS = ("ffn", "moe", "moe")
ROOT = Path(__file__).resolve().parents[3]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _ensure_tbo():
    """Register the tbo adapters when the distribution is not installed (a bare GPU machine)."""
    if str(ROOT / "plugins" / "tbo") not in sys.path:
        sys.path.append(str(ROOT / "plugins" / "tbo"))
    from layer_boundary_tbo.plugin import register_in_process

    register_in_process()


@pytest.fixture(autouse=True)
def _tbo_registered():
    _ensure_tbo()


def _close(out, want):
    """Float64 on the GPU: the grid sums are exact, the norms may round a reduction differently
    from the CPU (an ulp); anything the boundary gets wrong is off by far more."""
    out, want = out.cpu(), want.cpu()
    assert out.shape == want.shape
    assert (out - want).abs().max().item() <= 1e-12 * want.abs().max().item()


@pytest.mark.parametrize("scheduled", [(), (0, 1, 2)], ids=["exit", "scheduled"])
@pytest.mark.parametrize("streams", [True, False], ids=["2streams", "1stream"])
def test_tbo_on_cuda_matches_the_whole_batch(scheduled, streams):
    dp_segments = [[64, 3, 61, 128, 7, 9]]
    whole = run_exact_rank(Parallel.single(), LAYERS, dp_segments, device="cuda")
    out = run_exact_rank(
        Parallel.single(), LAYERS, dp_segments, device="cuda", tbo=True, split=split_of(dp_segments), scheduled=scheduled, streams=streams
    )
    _close(out, whole)
    _close(out, reference(LAYERS, dp_segments)[0])


def test_each_microbatch_runs_on_its_own_stream():
    model = ExactStack(LAYERS, Parallel.single(), device="cuda")
    segments = [4, 4]
    x = inputs_of([segments], device="cuda")[0]
    seen = {}
    inner = model.stages_of(0, model.num_layers)

    def stages(h, fwd, facts):
        run = inner(h, fwd, facts)
        while True:
            seen.setdefault(fwd.microbatch, set()).add(torch.cuda.current_stream().cuda_stream)
            try:
                next(run)
            except StopIteration as stop:
                return stop.value
            yield

    main = torch.cuda.current_stream().cuda_stream
    for streams in (True, False):
        seen.clear()
        fwd = Forward(Parallel.single(), 8)
        residual_batch.start(fwd)
        with torch.inference_mode():
            two_batch_overlap(fwd).run(stages, x, fwd, context=lambda a, b: rows_of(segments, a, b), streams=streams)
        if streams:
            assert len(seen[0]) == len(seen[1]) == 1 and seen[0] != seen[1] and main not in seen[0] | seen[1]
        else:
            assert seen[0] == seen[1] == {main}
        assert torch.cuda.current_stream().cuda_stream == main


def test_qwen3_moe_with_tbo_streams_matches_the_whole_batch_with_a_kv_cache(tmp_path):
    """Prefill cuts a request between the microbatches and decode reuses the cache across steps:
    the ordering between streams and the retained cache tensors keep it right."""
    from layer_boundary_models import family, model_config
    from layer_boundary.cli.runner import RunJob, make_requests, run_rank

    config = model_config("qwen3_moe")
    path = tmp_path / "w.pt"
    torch.save(family("qwen3_moe").random_weights(config, torch.float32, 3), path)
    prompts, decode = make_requests(config.vocab_size, 5, 40, 4, seed=2)
    job = RunJob(
        model="qwen3_moe", hf_config=dict(config.hf), topology=Topology(), reduction="ar", dtype="float32",
        device="cuda", weights=str(path), prompts=prompts, decode_tokens=decode,
    )
    whole = run_rank(Parallel.single(), job)["logits"]
    overlapped = run_rank(Parallel.single(), attrs.evolve(job, options={"tbo": True}))["logits"]
    for r in whole:
        for a, b in zip(whole[r], overlapped[r]):
            assert (a - b).abs().max().item() < 1e-4 * a.abs().max().item()


def _nccl_exact(parallel, *args, **kwargs):
    _ensure_tbo()
    return run_exact_rank(parallel, *args, **kwargs)


def test_tbo_over_two_ranks_on_the_gpu():
    """NCCL with a GPU a rank, or two ranks sharing one GPU over gloo."""
    from layer_boundary.launch import ProcessWorld

    os.environ.update(NCCL_ENV)
    dp_segments = [[64, 3, 61, 128, 7, 9]]
    world = ProcessWorld(2, device="cuda", env=NCCL_ENV, timeout=300)
    try:
        for kwargs in ({"policy": "ar"}, {"policy": "rs+rsv", "sp": True}):
            results = world.run(_nccl_exact, Topology(tp=2), LAYERS, dp_segments, device="cuda", tbo=True, split=split_of(dp_segments), **kwargs)
            want = reference(LAYERS, dp_segments)[0]
            for out in results:
                _close(out, want)
    finally:
        world.close()


def _tp_run(parallel, job):
    from layer_boundary.cli.runner import run_rank

    _ensure_tbo()
    return run_rank(parallel, job)["logits"]


def test_qwen3_moe_tp2_with_tbo_matches_the_whole_batch(tmp_path):
    """TP=2 (two ranks, sharing the GPU where there is one): TBO's logits against the non-TBO run."""
    from layer_boundary.launch import ProcessWorld
    from layer_boundary_models import family, model_config
    from layer_boundary.cli.runner import RunJob, make_requests

    config = model_config("qwen3_moe")
    path = tmp_path / "w.pt"
    torch.save(family("qwen3_moe").random_weights(config, torch.float32, 3), path)
    prompts, decode = make_requests(config.vocab_size, 6, 40, 3, seed=2)
    job = RunJob(model="qwen3_moe", hf_config=dict(config.hf), topology=Topology(tp=2), reduction="ar", dtype="float32",
                 device="cuda", weights=str(path), prompts=prompts, decode_tokens=decode)
    with ProcessWorld(2, device="cuda", env=NCCL_ENV, timeout=300) as world:
        whole = world.run(_tp_run, Topology(tp=2), job)
        overlapped = world.run(_tp_run, Topology(tp=2), attrs.evolve(job, options={"tbo": True}))
    worst = 0.0
    for rank_whole, rank_tbo in zip(whole, overlapped):
        assert rank_whole.keys() == rank_tbo.keys()
        for r in rank_whole:
            for a, b in zip(rank_whole[r], rank_tbo[r]):
                worst = max(worst, ((a - b).abs().max() / a.abs().max()).item())
    assert worst < 1e-4, f"TBO logits differ from the whole batch by {worst:.2e}"
    assert any(rank_whole for rank_whole in whole)


def test_the_overlap_script_runs_and_checks_tbo(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "bench", "tbo", "--", "--gpus", "2", "--hidden", "1024", "--heads", "8", "--kv-heads", "2",
         "--intermediate", "2048", "--layers", "2", "--requests", "4", "--tokens-per-request", "128",
         "--iters", "3", "--out", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ, **NCCL_ENV},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["check_max_rel_diff"] < 3e-2, result["check_max_rel_diff"]  # the script fails above it too
    assert "tbo-2streams" in out.stdout
