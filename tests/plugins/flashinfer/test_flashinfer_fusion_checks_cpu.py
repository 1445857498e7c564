"""The GPU tests' checks (`flashinfer_fusion_checks`) on the CPU: threaded TP=2 ranks, the
reference backend standing in for FlashInfer's kernels, bf16 on the CPU. Every check that needs
no GPU runs and passes, so what only the GPU machine runs is exercised on every machine."""

import pytest
import torch

from flashinfer_fakes import ReferenceBackend, hardware_present
from flashinfer_fusion_checks import (
    Case, check_boundary, check_fallback, check_finalize, check_fp8_reads, check_model, check_twoshot, compare_fp8,
)
from layer_boundary import Topology
from layer_boundary.testing.threaded import run_threaded
from layer_boundary_flashinfer import service
from layer_boundary_flashinfer.workspace import WorkspaceManager

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96}
CASE = Case(device="cpu", hidden=64, max_tokens=256, sizes={
    "qwen3": TINY, "gemma": dict(TINY, num_key_value_heads=1),
    "qwen3_moe": dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[2])})


@pytest.fixture
def on_cpu(monkeypatch):
    backend = ReferenceBackend(finalize_tokens=128)
    monkeypatch.setattr(service, "_DEFAULT", WorkspaceManager(backend))
    with hardware_present():
        yield backend


def _every_check(parallel, case):
    checks = {}
    for check in (check_boundary, check_twoshot, check_finalize, check_fallback, check_fp8_reads):
        checks[check.__name__] = check(parallel, case)
    for name in ("qwen3", "qwen3_moe"):
        checks[f"model {name}"] = check_model(parallel, case, name)
    checks["shadowed qwen3"] = check_model(parallel, case, "qwen3", shadow=True)
    return checks


def test_the_gpu_tests_checks_pass_on_the_reference_backend(on_cpu):
    results = run_threaded(_every_check, Topology(tp=2), CASE, timeout=240)
    for per_check in results:
        for check, items in per_check.items():
            failed = [c for c in items if not c["ok"]]
            assert items and not failed, (check, failed)
        assert sum(len(items) for items in per_check.values()) > 40
        assert per_check["shadowed qwen3"][-1]["calls"] > 0
    assert on_cpu.count("all_reduce_fp8") > 0 and on_cpu.count("finalize") > 0
    assert not any(s.available for s in service.default_manager().slots.values()), "a check left a workspace"
    assert ReferenceBackend.bind_all_reduce.__qualname__ == "ReferenceBackend.bind_all_reduce", "the shadow stayed installed"


def test_the_fp8_bound_is_half_a_step_of_the_exact_norm():
    from layer_boundary.plugin import quantize_fp8

    y = torch.randn(4, 64, dtype=torch.float32) * 3
    exact = quantize_fp8(y, torch.bfloat16, None)
    flashinfers = quantize_fp8(y.to(torch.bfloat16).float(), torch.bfloat16, None)  # its rounding point
    facts = compare_fp8(flashinfers, exact, y)
    assert facts["max_err_over_bound"] <= 1.0 and facts["bytes_differing"] < 0.1
    assert compare_fp8(exact, exact, y)["max_err_over_bound"] <= 1.0
    off = quantize_fp8(y * 1.2, torch.bfloat16, None)  # a wrong read is far outside
    assert compare_fp8(off, exact, y)["max_err_over_bound"] > 3
    inside = y / 2  # within the fixed scale's range (|y| < 8): saturation is no rounding
    static = quantize_fp8(inside, torch.bfloat16, torch.tensor(8.0 / 448.0))
    assert compare_fp8(static, static, inside)["max_err_over_bound"] <= 1.0
