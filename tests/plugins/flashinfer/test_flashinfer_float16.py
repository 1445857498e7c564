"""float16 models take the fused path like bfloat16 ones (`--dtype float16`): the workspace is
made in float16, every eligible stage is bound, and the fused logits equal the unfused ones."""

import pytest
import torch

from flashinfer_fakes import ReferenceBackend, hardware_present, model_logits, prompt_batches, tiny_model
from layer_boundary import Topology
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer.eligibility import SUPPORTED_DTYPES
from layer_boundary_flashinfer.service import prepare_flashinfer_fusion
from layer_boundary_flashinfer.workspace import WorkspaceManager


def _fp16_rank(parallel, name):
    backend = ReferenceBackend()
    manager = WorkspaceManager(backend)
    with hardware_present():
        config, model = tiny_model(name, parallel, dtype=torch.float16)
    prompts = prompt_batches(config)
    unfused = model_logits(model, parallel, prompts)
    report = prepare_flashinfer_fusion(model, max_tokens=64, manager=manager)
    fused = model_logits(model, parallel, prompts)
    manager.shutdown()
    return report, unfused, fused, backend.count("all_reduce", parallel.rank)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_a_float16_model_is_fused(name):
    assert torch.float16 in SUPPORTED_DTYPES
    for report, unfused, fused, launches in run_threaded(_fp16_rank, Topology(tp=2), name, timeout=60):
        assert report.available and report.bound and {g.dtype for g in report.groups} == {"torch.float16"}, str(report)
        assert launches > 0
        for a, b in zip(unfused, fused):
            assert a.dtype == torch.float16 and torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
