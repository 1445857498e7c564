"""On a Hopper or Blackwell GPU machine with flashinfer installed: the plugin's GPU check
(`python -m layer_boundary_flashinfer.gpu_check`) at 2 ranks, one GPU each or sharing one GPU:
fused boundaries, two-shot, MoE finalize, the fallback, FlashInfer's kernel limits, FP8 reads,
qwen3 / gemma / qwen3_moe logits with the plugin on and off, and whole decode steps captured in a
CUDA graph. `scripts/gpu_tests.sh run flashinfer` runs the same check with its logs kept."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (two ranks share it if there is one)"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"),
]


@pytest.mark.timeout(900)
def test_flashinfer_gpu_check_passes_at_two_ranks(tmp_path):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    proc = subprocess.run([sys.executable, "-m", "layer_boundary_flashinfer.gpu_check", "--ranks", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed and len(result["checks"]) > 20, failed
    assert result["fast_path"].get("all_reduce") is True
