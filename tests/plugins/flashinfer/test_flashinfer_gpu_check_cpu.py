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
    args = types.SimpleNamespace(hidden=64, max_tokens=256, models=["qwen3", "qwen3_moe"], graph_models=[], model_sizes="check", dense_moe=False)
    results = run_threaded(_steps, Topology(tp=2), args, timeout=240)
    for items in results:
        failed = [c for c in items if not c["ok"]]
        assert not failed, failed
        steps = {c["step"] for c in items}
        assert steps == set(CPU_STEPS)
        assert len(items) > 40
    assert on_cpu.count("all_reduce_fp8") > 0 and on_cpu.count("finalize") > 0


def test_the_fp8_bound_is_half_a_step_of_the_exact_norm():
    from layer_boundary.plugin import quantize_fp8

    y = torch.randn(4, 64, dtype=torch.float32) * 3
    exact = quantize_fp8(y, torch.bfloat16, None)
    flashinfers = quantize_fp8(y.to(torch.bfloat16).float(), torch.bfloat16, None)  # its rounding point
    facts = fp8_check._compare(flashinfers, exact, y)
    assert facts["max_err_over_bound"] <= 1.0 and facts["bytes_differing"] < 0.1
    assert fp8_check._compare(exact, exact, y)["max_err_over_bound"] <= 1.0
    off = quantize_fp8(y * 1.2, torch.bfloat16, None)  # a wrong read is far outside
    assert fp8_check._compare(off, exact, y)["max_err_over_bound"] > 3
    inside = y / 2  # within the fixed scale's range (|y| < 8): saturation is no rounding
    static = quantize_fp8(inside, torch.bfloat16, torch.tensor(8.0 / 448.0))
    assert fp8_check._compare(static, static, inside)["max_err_over_bound"] <= 1.0
