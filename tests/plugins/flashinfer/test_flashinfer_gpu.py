"""On 2 GPUs (Hopper or Blackwell, one host, flashinfer installed): the plugin's GPU check
(`python -m layer_boundary_flashinfer.gpu_check`): fused boundaries and MoE finalize against the
unfused path, CUDA-graph replay, and qwen3 / gemma / qwen3_moe logits at TP=2 with the plugin on
and off. `plugins/flashinfer/gpu_check.sh` runs the same check, then the benchmark."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python"),
]


@pytest.mark.timeout(900)
def test_flashinfer_gpu_check_passes_on_two_gpus(tmp_path):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    proc = subprocess.run([sys.executable, "-m", "layer_boundary_flashinfer.gpu_check", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed and len(result["checks"]) > 20, failed
    assert result["fast_path"].get("all_reduce") is True
