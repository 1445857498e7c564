"""The GPU check's own logic on the CPU (threaded TP=2, the reference backend standing in for the
kernels, bf16 on the CPU): every step that does not need a GPU runs and passes, so the script that
only the GPU machine runs cannot rot between GPU sessions."""

import types

import pytest
import torch

from flashinfer_fakes import ReferenceBackend, hardware_present
from layer_boundary import Topology
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer import fp8_check, gpu_check, service
from layer_boundary_flashinfer.workspace import WorkspaceManager

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96}
CPU_STEPS = ("boundary", "twoshot", "finalize", "fallback", "fp8", "models")


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    monkeypatch.setattr(gpu_check, "MODEL_SIZES", {
        "qwen3": TINY, "gemma": dict(TINY, num_key_value_heads=1),
        "qwen3_moe": dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[2])})
    backend = ReferenceBackend(finalize_tokens=128)
    monkeypatch.setattr(service, "_DEFAULT", WorkspaceManager(backend))
    with hardware_present():
        yield backend


def _steps(parallel, args):
    checks = gpu_check.Checks(parallel.rank)
    for step in CPU_STEPS:
        checks.step = step
        with torch.no_grad():
            gpu_check.STEP_FUNCTIONS[step](checks, parallel, parallel.rank, args)
    service.shutdown_flashinfer_fusion()
    return checks.items


def test_the_gpu_checks_steps_pass_on_the_reference_backend(on_cpu):
    args = types.SimpleNamespace(hidden=64, max_tokens=256, models=["qwen3", "qwen3_moe"], graph_models=[])
    results = run_threaded(_steps, Topology(tp=2), args, timeout=240)
    for items in results:
        failed = [c for c in items if not c["ok"]]
        assert not failed, failed
        steps = {c["step"] for c in items}
        assert steps == set(CPU_STEPS)
        assert len(items) > 40
    assert on_cpu.count("all_reduce_fp8") > 0 and on_cpu.count("finalize") > 0


def test_fp8_tolerances_count_one_e4m3_step():
    from layer_boundary.residual.quant import quantize_fp8

    y = torch.randn(4, 64, dtype=torch.float32)
    a = quantize_fp8(y, torch.bfloat16, None)
    b = quantize_fp8(y.to(torch.bfloat16).float(), torch.bfloat16, None)  # FlashInfer's rounding point
    facts = fp8_check._compare(b, a)
    assert facts["max_dequant_diff_in_steps"] <= 1.0 and facts["bytes_differing"] < 0.1
    far = quantize_fp8(y * 1.5, torch.bfloat16, None)
    assert fp8_check._compare(far, a)["scale_rel_diff"] > 0.4
