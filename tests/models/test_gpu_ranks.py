"""Several ranks on the GPU machine: one GPU a rank over NCCL, or ranks sharing a GPU over gloo
(CUDA tensors staged through the host). Collectives, the CLI's `--device cuda --tp N`, and a
whole model at TP=2 against a single rank. Run by scripts/gpu_tests.sh; skipped without CUDA."""

import json
import os
import subprocess
import sys

import pytest
import torch

from layer_boundary import Topology

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _collectives(parallel):
    group = parallel.groups["tp"]
    dev = torch.device("cuda", torch.cuda.current_device())
    r, n = group.rank, group.size
    x = torch.full((4, 8), float(r + 1), device=dev, dtype=torch.bfloat16)
    summed = group.all_reduce(x.clone())
    scattered = group.reduce_scatter(torch.arange(4 * n * 2, device=dev, dtype=torch.float32).view(4 * n, 2))
    gathered = group.all_gather(torch.full((2, 3), float(r), device=dev))
    sizes = tuple(i + 1 for i in range(n))
    gatheredv = group.all_gatherv(torch.full((sizes[r], 3), float(r), device=dev), sizes)
    return {
        "devices": {t.device.type for t in (summed, scattered, gathered, gatheredv)},
        "sum": summed.float().unique().tolist(),
        "scattered": scattered.cpu(),
        "gathered": gathered[:, 0].cpu().tolist(),
        "gatheredv": gatheredv[:, 0].cpu().tolist(),
        "agree_all": group.agree(True),
        "agree_one_no": group.agree(r != 0),
        "host_staged": getattr(group, "host_staged", None),
    }


def test_collectives_move_cuda_tensors_between_ranks(gpu_world):
    world = gpu_world(2)
    results = world.run(_collectives, Topology(tp=2))
    for rank, res in enumerate(results):
        assert res["devices"] == {"cuda"}
        assert res["sum"] == [3.0]
        want = torch.arange(16, dtype=torch.float32).view(8, 2) * 2
        assert torch.equal(res["scattered"], want[rank * 4 : rank * 4 + 4])
        assert res["gathered"] == [0.0, 0.0, 1.0, 1.0] and res["gatheredv"] == [0.0, 1.0, 1.0]
        assert res["agree_all"] is True and res["agree_one_no"] is False
        assert res["host_staged"] is (world.backend == "gloo")


#: a MoE in bf16 is checked in float32: a routing choice between two experts of nearly equal score
#: can flip between the fused GPU sums and the CPU reference's rounding, and one flip moves logits
#: far beyond the bf16 tolerance without anything being wrong
@pytest.mark.parametrize("model,dtype", [("qwen3", "bfloat16"), ("qwen3_moe", "float32")])
def test_run_on_the_gpu_at_tp2_matches_a_single_rank(model, dtype):
    proc = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "run", "--model", model, "--tp", "2", "--device", "cuda", "--check", "single",
         "--json", "--decode-steps", "2", "--dtype", dtype],
        capture_output=True, text=True, timeout=480, env=ENV,  # qwen3 bf16 took 284 s on one H200 (two ranks sharing it)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["check"]["passed"] is True, out["check"]
    if torch.cuda.device_count() < 2:
        assert "2 ranks on 1 GPU: correctness only; timings are not representative" in proc.stderr


#: the MoE models' default check on the GPU: bf16 (the default there) against Hugging Face, with
#: every installed plugin on; the verdict holds the routing to the reference's choices and bounds
#: the logits by the dtype's tolerance (docs/verdicts.md)
MOE_DEFAULT_CHECKS = {
    "qwen3_moe-tp2": ("qwen3_moe", "--tp", "2"),
    "qwen3_moe-tp4-attn-dp2": ("qwen3_moe", "--tp", "4", "--attn-dp", "2"),
    "deepseek_v4-tp2": ("deepseek_v4", "--tp", "2"),
}


@pytest.mark.parametrize("case", list(MOE_DEFAULT_CHECKS))
def test_a_moe_model_passes_its_default_bf16_check_with_the_plugins_on(case):
    model, *topology = MOE_DEFAULT_CHECKS[case]
    proc = subprocess.run(
        [sys.executable, "-m", "layer_boundary", "run", "--model", model, *topology, "--device", "cuda", "--json", "--decode-steps", "2"],
        capture_output=True, text=True, timeout=540, env=ENV,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    print(case, json.dumps({k: out["check"].get(k) for k in ("passed", "rel_err", "tolerance", "max_abs_err", "reference")}))
    assert out["config"]["dtype"] == "bfloat16" and out["check"]["passed"] is True, out["check"]
    plugins = {c.get("plugin") for b in out["kernels"]["boundaries"] for c in b["candidates"] if c.get("accepted")}
    print(case, "accepting plugins:", sorted(p or "core" for p in plugins))
